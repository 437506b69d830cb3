"""The engine: the reference, the device programs, the save and restore pipelines."""
