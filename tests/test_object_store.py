"""Checkpoints on an S3-compatible object store (issue 12): a real S3 server (moto, in server
mode on 127.0.0.1) reached through ``etils.epath`` -> fsspec -> s3fs, as Orbax reaches it.

Covered: a manager saving a base and a delta to ``s3://`` and restoring them (bit for bit the
same as the same saves on local disk; exact leaves exact, lossy leaves within their recorded
error); a fresh manager listing and restoring; the default manager choosing Orbax's
``COMMIT_FILE`` commit on ``s3://`` by itself; the read tools (``checkpoint_stats``, the CLI's
``list``, ``inspect``, ``verify`` and ``export`` from ``s3://``, chain dependencies); a damaged
payload object and a damaged manifest detected; the handler's own save / finalize / restore on
``s3://`` paths without Orbax's commit; a partial-experts (PEC) save and restore; path
normalisation of URIs. What Orbax itself needs on S3 is in ``docs/object_stores.md``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

import orbax.checkpoint as ocp  # noqa: E402
from etils import epath  # noqa: E402
from orbax.checkpoint import options as ocp_options  # noqa: E402

import orbax_lossy as ol  # noqa: E402
from orbax_lossy import cli  # noqa: E402
from orbax_lossy.format import steps  # noqa: E402
from orbax_lossy.format.manifest import read_manifest_body  # noqa: E402

BUCKET = "orbax-lossy-test"
# Orbax's default commit for a non-gs:// path renames <step>.orbax-checkpoint-tmp, which
# etils/fsspec cannot do on S3 (docs/object_stores.md): commit in place with a commit file.
COMMIT_FILE = ocp.CheckpointManagerOptions(
    atomicity_options=ocp_options.AtomicityOptions(mode=ocp_options.AtomicityMode.COMMIT_FILE)
)


def _clear_fsspec_caches() -> None:
    """Forget S3 clients made for another endpoint (etils and fsspec cache them)."""
    import s3fs
    from etils.epath import backend

    s3fs.S3FileSystem.clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; yields a boto3 client."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # honoured by botocore and aiobotocore (s3fs), so by epath.Path("s3://...")
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("AWS_PROFILE", raising=False)
        _clear_fsspec_caches()
        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"])
        client.create_bucket(Bucket=BUCKET)
        try:
            yield client
        finally:
            _clear_fsspec_caches()
            server.stop()


def _keys(client, prefix: str) -> dict[str, int]:
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: o["Size"] for o in listed}


def _state(t: int) -> dict:
    rng = np.random.default_rng(t)
    return {
        "params": {"w": jnp.asarray(np.sin(np.arange(64 * 48).reshape(64, 48) * 0.01 + 0.1 * t)
                                    + 0.01 * rng.standard_normal((64, 48)), jnp.float32)},
        "opt": {"mu": jnp.asarray(0.001 * rng.standard_normal((64, 48)), jnp.float32)},
        "step": jnp.int32(t),
        "host": np.linspace(0.0, 1.0, 7) + t,
    }


def _flat(tree) -> dict:
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}


def _save_two(directory: str, options=None) -> list[dict]:
    """A base (step 0) and a delta (step 1) of _state; returns the saved states."""
    mngr = ol.checkpoint_manager(directory, options=options, base_interval=4,
                                 enable_async_checkpointing=False)
    saved = []
    for t in (0, 1):
        saved.append(_state(t))
        mngr.save(t, args=ol.LossySave(saved[-1]))
    mngr.wait_until_finished()
    mngr.close()
    return saved


@pytest.fixture(scope="module")
def saved_root(s3, tmp_path_factory):
    """The same two saves in ``s3://BUCKET/run`` and on local disk."""
    local = str(tmp_path_factory.mktemp("local_twin"))
    root = f"s3://{BUCKET}/run"
    saved = _save_two(root, COMMIT_FILE)
    _save_two(local)
    return root, local, saved


def test_manager_saves_a_base_and_a_delta_on_s3(s3, saved_root) -> None:
    root, _, _ = saved_root
    keys = _keys(s3, "run/")
    for step in (0, 1):
        assert {f"{step}/default/manifest.msgpack", f"{step}/default/data.p0.bin",
                f"{step}/default/commit_success.txt"} <= set(keys), sorted(keys)
        assert not any(k.startswith(f"{step}/default/index.") for k in keys)  # merged
    assert not any(".orbax-checkpoint-tmp" in k or "lock" in k for k in keys), sorted(keys)
    kinds = [read_manifest_body(f"{root}/{s}/default")["kind"] for s in (0, 1)]
    assert kinds == ["base", "delta"]
    assert read_manifest_body(f"{root}/1/default")["reference"]["relpath"] == "../../0/default"
    assert ol.chain_dependencies(root) == {0: [], 1: [0]}


def test_fresh_manager_restores_what_local_disk_restores(saved_root) -> None:
    root, local, saved = saved_root
    reader = ol.checkpoint_manager(root, options=COMMIT_FILE)
    assert reader.all_steps() == [0, 1]
    local_reader = ol.checkpoint_manager(local)
    for step in (0, 1):
        got = _flat(reader.restore(step))
        twin = _flat(local_reader.restore(step))
        want = _flat(saved[step])
        assert got.keys() == want.keys()
        stats = {row["path"]: row for row in ol.checkpoint_stats(f"{root}/{step}/default")}
        for name, value in got.items():
            # the object store changes nothing: the same bits as the same saves on disk
            np.testing.assert_array_equal(value, twin[name], err_msg=f"{step} {name}")
            if stats[name]["rel_error"] == 0:
                np.testing.assert_array_equal(value, want[name], err_msg=f"{step} {name}")
            else:  # lossy: within the error recorded at save time
                err = np.linalg.norm(value - want[name]) / np.linalg.norm(want[name])
                assert err <= stats[name]["rel_error"] * (1 + 1e-3) + 1e-7, (step, name, err)
    assert stats["params/w"]["codec"]["id"] != "exact"  # something was lossy
    reader.close()
    local_reader.close()


def test_read_tools_work_on_s3(saved_root, capsys) -> None:
    root, _, _ = saved_root
    assert steps.step_directories(root) == {0: f"{root}/0", 1: f"{root}/1"}
    assert cli.main(["verify", root]) == 0
    out = capsys.readouterr().out
    assert "step 0 (base)" in out and "step 1 (delta)" in out and "checksums match" in out
    assert cli.main(["verify", f"{root}/1/default"]) == 0
    assert "verified" in capsys.readouterr().out
    assert cli.main(["inspect", f"{root}/1/"]) == 0
    assert "params/w" in capsys.readouterr().out
    assert cli.main(["inspect", root, "--step", "0"]) == 0
    assert "chain, base first: 0 (base)\n" in capsys.readouterr().out


def test_cli_list_on_s3_matches_local_disk(saved_root, capsys) -> None:
    root, local, _ = saved_root
    for path in (root, root + "/"):
        assert cli.main(["list", path]) == 0
        out = capsys.readouterr().out
        assert out.startswith(root + "\n"), out  # the URI, not <cwd>/s3:/...
        assert "base" in out and "delta" in out
    assert cli.main(["list", local]) == 0
    local_out = capsys.readouterr().out
    # the same rows (sizes, ratios, dependencies) as the same saves on disk
    assert out.split("\n", 1)[1] == local_out.split("\n", 1)[1]


def test_cli_list_of_an_empty_s3_prefix_says_so(s3) -> None:
    with pytest.raises(SystemExit, match="holds no orbax-lossy steps"):
        cli.main(["list", f"s3://{BUCKET}/nothing-here"])


def test_cli_export_reads_from_s3(saved_root, tmp_path, capsys) -> None:
    root, local, _ = saved_root
    assert cli.main(["export", root, str(tmp_path / "plain"), "--step", "1"]) == 0
    assert f"exported {root}/1/default -> " in capsys.readouterr().out
    got = _flat(ocp.StandardCheckpointer().restore(tmp_path / "plain"))
    want = _flat(ol.checkpoint_manager(local).restore(1))
    assert got.keys() == want.keys()
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_default_manager_commits_in_place_on_s3(s3) -> None:
    """No hand-set atomicity: ``checkpoint_manager`` picks COMMIT_FILE for ``s3://``."""
    root = f"s3://{BUCKET}/default-options"
    caller = ocp.CheckpointManagerOptions(max_to_keep=5)
    saved = _save_two(root, caller)
    assert caller.atomicity_options is None  # the caller's options are not modified
    keys = _keys(s3, "default-options/")
    assert {"0/default/commit_success.txt", "1/default/commit_success.txt"} <= set(keys)
    assert not any(".orbax-checkpoint-tmp" in k for k in keys), sorted(keys)
    no_options = f"s3://{BUCKET}/no-options"  # options=None and async saves: the same
    with ol.checkpoint_manager(no_options, base_interval=4) as mngr:
        for t in (0, 1):
            mngr.save(t, args=ol.LossySave(_state(t)))
    assert "1/default/commit_success.txt" in _keys(s3, "no-options/")
    reader = ol.checkpoint_manager(root)
    assert reader.all_steps() == [0, 1]
    assert reader._options.atomicity_options.mode == ocp_options.AtomicityMode.COMMIT_FILE
    got = _flat(reader.restore(1))
    np.testing.assert_array_equal(got["step"], np.asarray(saved[1]["step"]))
    np.testing.assert_array_equal(got["host"], saved[1]["host"])
    reader.close()
    assert ol.chain_dependencies(no_options) == {0: [], 1: [0]}


def test_commit_mode_choice_leaves_explicit_choices_alone() -> None:
    from orbax.checkpoint._src.path import atomicity

    from orbax_lossy.manager import object_store_options

    mode = ocp_options.AtomicityMode
    default = ocp.CheckpointManagerOptions()
    for path in ("/tmp/x", "relative", "gs://b/x"):
        assert object_store_options(default, path) is default
    for path in ("s3://b/x", "az://c/x"):
        got = object_store_options(default, path)
        assert got.atomicity_options.mode == mode.COMMIT_FILE and default.atomicity_options is None
    legacy = ocp.CheckpointManagerOptions(
        atomicity_options=ocp_options.AtomicityOptions(allow_legacy_atomic_rename=True))
    got = object_store_options(legacy, "s3://b/x").atomicity_options
    assert got == ocp_options.AtomicityOptions(mode.COMMIT_FILE, allow_legacy_atomic_rename=True)
    assert legacy.atomicity_options.mode == mode.AUTO
    explicit = ocp.CheckpointManagerOptions(
        atomicity_options=ocp_options.AtomicityOptions(mode=mode.ATOMIC_RENAME))
    assert object_store_options(explicit, "s3://b/x") is explicit
    by_class = ocp.CheckpointManagerOptions(
        temporary_path_class=atomicity.AtomicRenameTemporaryPath)
    assert object_store_options(by_class, "s3://b/x") is by_class


def test_damage_on_s3_is_detected(s3, tmp_path) -> None:
    root = f"s3://{BUCKET}/damaged"
    saved = _save_two(root, COMMIT_FILE)
    key = "damaged/0/default/data.p0.bin"
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x40
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    reader = ol.checkpoint_manager(root, options=COMMIT_FILE)
    with pytest.raises(ol.ChecksumError, match="checksum mismatch"):
        reader.restore(1)  # the delta needs its base
    assert cli.main(["verify", root]) == 2
    # A damaged manifest is refused as well; step 0's exact leaves are then unreadable too.
    mkey = "damaged/1/default/manifest.msgpack"
    manifest = bytearray(s3.get_object(Bucket=BUCKET, Key=mkey)["Body"].read())
    manifest[-3] ^= 0x01
    s3.put_object(Bucket=BUCKET, Key=mkey, Body=bytes(manifest))
    with pytest.raises(ol.FormatError):
        reader.restore(1)
    s3.delete_object(Bucket=BUCKET, Key="damaged/0/default/data.p0.bin")
    with pytest.raises(ol.FormatError, match="missing"):
        ol.LossyCheckpointHandler().restore(epath.Path(f"{root}/0/default"))
    reader.close()
    del saved


def test_handler_reads_and_writes_without_orbax_commit(s3) -> None:
    """The handler's own I/O on ``s3://`` item directories (what Orbax's commit wraps)."""
    root = f"s3://{BUCKET}/bare"
    handler = ol.LossyCheckpointHandler(base_interval=4, unmanaged_deltas=True)
    saved = []
    for t in (0, 1):
        item = epath.Path(f"{root}/{t}/default")
        saved.append(_state(t))
        handler.save(item, args=ol.LossySave(saved[-1]))
        assert "index.p0.msgpack" in _keys(s3, f"bare/{t}/default/")
        handler.finalize(item)
    assert set(_keys(s3, "bare/1/default/")) == {"manifest.msgpack", "data.p0.bin"}
    assert read_manifest_body(f"{root}/1/default")["kind"] == "delta"
    handler.close()
    fresh = ol.LossyCheckpointHandler()
    restored = _flat(fresh.restore(epath.Path(f"{root}/1/default")))
    want = _flat(saved[1])
    np.testing.assert_array_equal(restored["step"], want["step"])
    np.testing.assert_array_equal(restored["host"], want["host"])
    # the state moves by ~10% per save; the default Step(2.5) delta errs by up to half a step
    assert np.linalg.norm(restored["params/w"] - want["params/w"]) < 0.1 * np.linalg.norm(
        want["params/w"])
    assert fresh.last_restore_bytes_read > 0
    fresh.close()


def test_uri_paths_are_normalised_lexically() -> None:
    assert steps.is_remote("s3://b/x") and steps.is_remote(epath.Path("gs://b/x"))
    assert not steps.is_remote("/tmp/s3://x") and not steps.is_remote("relative/dir")
    assert steps.abspath("s3://b/run/./0.orbax-checkpoint-tmp/default/") == (
        "s3://b/run/0.orbax-checkpoint-tmp/default")
    item = steps.final_path(steps.abspath(epath.Path("s3://b/run/3.orbax-checkpoint-tmp/"
                                                     "default.orbax-checkpoint-tmp")))
    assert item == "s3://b/run/3/default"
    assert steps.root_of(item) == "s3://b/run" and steps.step_of(item) == 3
    assert steps.root_key("gs://b/run/") == "gs://b/run"
    assert steps.relpath("s3://b/run/0/default", item) == "../../0/default"
    assert steps.inside("s3://b/run/0", "s3://b/run")
    assert not steps.inside("s3://b/running", "s3://b/run")
    assert not steps.inside("gs://b/run/0", "s3://b/run")
    assert steps.normpath("s3://b/run/1/default/../../../../x") == "s3://x"
    with pytest.raises(ValueError):
        steps.relpath("s3://b/x", "/local/x")


def test_partial_experts_save_and_restore_on_s3(s3, tmp_path) -> None:
    """PEC (K=2 of 8 experts per save) on ``s3://``: the restore assembles every expert from
    its newest holder, as the same saves on local disk do."""
    from orbax_lossy.policy.base import ROLES

    rules = [(r"moe/(w_in|b_in|w_out|b_out)$", 0)]
    exact = ol.LeafPolicy.create(defaults={r: ol.Exact() for r in ROLES})
    root, local = f"s3://{BUCKET}/pec", str(tmp_path / "pec")

    def manager(directory: str):
        return ol.checkpoint_manager(directory, partial_experts=ol.PartialExperts(k=2, rules=rules),
                                     policy=exact, max_to_keep=10, base_interval=10)

    def state(t: int) -> dict:  # a tiny MoE: 8 stacked experts in 2 layers, and AdamW's mu
        rng = np.random.default_rng(t)
        layers = {str(i): {"moe": {"router": jnp.asarray(rng.standard_normal((4, 8)), jnp.float32),
                                   "w_in": jnp.asarray(rng.standard_normal((8, 4, 6)), jnp.float32),
                                   "b_in": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)}}
                  for i in range(2)}
        return {"params": {"blocks": layers, "embed": jnp.full((5, 4), t, jnp.float32)},
                "opt_state": {"mu": {"blocks": jax.tree.map(lambda x: 0.1 * x, layers)},
                              "count": jnp.int32(t)}}

    states = {step: state(step) for step in (2, 4, 6)}
    managers = [manager(root), manager(local)]
    for step, value in states.items():
        for m in managers:
            m.save(step, args=ol.LossySave(value))
            m.wait_until_finished()
    for m in managers:
        m.close()
    report = ol.partial_experts_report(f"{root}/6/default")
    assert report["k"] == 2 and report["full"] is False
    restored = []
    for directory in (local, root):
        m = manager(directory)
        restored.append(_flat(m.restore(6, args=ol.LossyRestore(jax.tree.map(jnp.zeros_like,
                                                                              states[6])))))
        m.close()
    twin, got = restored
    assert got.keys() == twin.keys() == _flat(states[6]).keys()
    for name, value in got.items():
        np.testing.assert_array_equal(value, twin[name], err_msg=name)
    # every expert from its newest holder (weights and moments alike), the rest from step 6
    for group in ("blocks/0/moe", "blocks/1/moe"):
        holders = report["expert_steps"][group]
        assert sorted(set(holders)) == [2, 4, 6] and holders.count(6) == 2, holders
        for name in (f"params/{group}/w_in", f"opt_state/mu/{group}/b_in"):
            for e, h in enumerate(holders):
                np.testing.assert_array_equal(got[name][e], _flat(states[h])[name][e], name)
    for name in ("params/embed", "params/blocks/0/moe/router", "opt_state/count"):
        np.testing.assert_array_equal(got[name], _flat(states[6])[name], name)
