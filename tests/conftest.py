from __future__ import annotations

import os

import pytest

from tests.whole import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401 - hooks: a skip fails

# tests/gpu needs a CUDA device: `make test-gpu` collects it (REVAL_GPU_TESTS=1); `make test` (CI, CPU) doesn't,
# so that every test CI collects also runs there.
collect_ignore = [] if os.environ.get("REVAL_GPU_TESTS") else ["gpu"]


@pytest.fixture(autouse=True, scope="session")
def _control_sockets_in_tmp(tmp_path_factory):
    """ssh ControlMaster socket folders of this session and its subprocesses (a controller killed by a test
    cannot clean up its own) live in pytest's tmp dir, not /tmp. Short path: socket paths max ~100 bytes."""
    root = tmp_path_factory.mktemp("cm", numbered=False)
    old = os.environ.get("REVAL_CONTROL_ROOT")
    os.environ["REVAL_CONTROL_ROOT"] = str(root)
    yield
    if old is None:
        os.environ.pop("REVAL_CONTROL_ROOT", None)
    else:
        os.environ["REVAL_CONTROL_ROOT"] = old


@pytest.fixture(autouse=True, scope="session")
def _kernel_caches_in_tmp(tmp_path_factory):
    """The payload's kernel caches (remote_payload/runtime/kcache.py: by default in the venv, here the shared
    one) of this session and its subprocesses live in pytest's tmp dir. tests/test_kcache.py clears it where
    it checks the venv default."""
    if os.environ.get("REVAL_KERNEL_CACHES"):
        yield
        return
    os.environ["REVAL_KERNEL_CACHES"] = str(tmp_path_factory.mktemp("kernel-caches"))
    yield
    os.environ.pop("REVAL_KERNEL_CACHES", None)


# --- real OpenSSH sshd hosts (hosts engineer) -----------------------------------------------------------
@pytest.fixture
def ssh_hosts(tmp_path_factory):
    """Factory: `ssh_hosts(n, known=True, host_key="strict", extra=None) -> tests.sshd.SshHosts`.

    Starts n real sshd on 127.0.0.2.. (port 2222) inside the private netns, writes an inventory yaml
    (`.inventory_path`, hosts ssh1..sshN, group `cluster`). Skips, saying why, outside scripts/netns-run.
    Teardown: iptables rules undone, every sshd (and its sessions) killed by pid, ssh masters closed."""
    from orchestrator.hosts import transport
    from tests import sshd

    reason = sshd.netns_skip_reason()
    if reason:
        pytest.skip(reason)
    made: list[sshd.SshHosts] = []
    from tests.workers import first_sshd_address
    next_addr = [first_sshd_address()]

    def factory(n: int, **kw) -> sshd.SshHosts:
        cluster = sshd.make_ssh_hosts(tmp_path_factory.mktemp("sshd"), n, first_address=next_addr[0], **kw)
        next_addr[0] += n
        made.append(cluster)
        return cluster

    yield factory
    transport.close_all()
    for cluster in made:
        cluster.close()


# --- a real single-node Slurm (slurm engineer) -----------------------------------------------------------
@pytest.fixture
def slurm(tmp_path_factory):
    """A started `tests.slurm.SlurmCluster` (munged, slurmctld, slurmd on 127.0.0.1, 2 fake GPUs, 8 CPU slots).

    Client commands: `slurm.cmd("sbatch", ...)` or any subprocess with `env=slurm.env` (SLURM_CONF).
    Skips, saying why, outside scripts/netns-run or without the Debian packages. Teardown: jobs cancelled,
    daemons ended by pid, leftover job processes killed by pid."""
    from tests import slurm as slurm_mod

    reason = slurm_mod.slurm_skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = slurm_mod.make_slurm(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.close()


@pytest.fixture
def slurm_login(slurm, ssh_hosts):
    """(slurm, login) — one loopback sshd whose sessions see the test cluster's SLURM_CONF: the login node."""
    return slurm, ssh_hosts(1, sshd_extra=slurm.sshd_extra())


# --- trained tiny fixtures (cache/target engineer) ------------------------------------------------------
def _build_trained_fixtures(log=lambda line: None):
    from pathlib import Path

    from remote_payload.tools import fixtures

    root = Path(__file__).resolve().parents[1] / ".cache" / "fixtures"
    fixtures.build(root, log=log)
    return root


def pytest_collection_finish(session):
    """Build the trained fixtures before the first test when a selected test uses them, so that the build
    (~1-3 min on 2 busy cores, longer under load) does not count against that test's timeout."""
    if any("trained_fixtures" in getattr(item, "fixturenames", ()) for item in session.items):
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("trained_fixtures: checking/building .cache/fixtures (reused while the recipe matches)")
        _build_trained_fixtures()


@pytest.fixture(scope="session")
def trained_fixtures():
    """The fixture dir (layout: remote_payload/tools/fixtures.py docstring; fixtures.json holds paths + quality).

    Built once into <repo>/.cache/fixtures/ and reused while its recipe hash matches; concurrent test
    sessions wait on a file lock instead of building twice."""
    return _build_trained_fixtures()


@pytest.fixture(scope="session")
def fx(trained_fixtures):
    """The trained fixtures' paths by name (fixtures.json's "paths": target, cache, drafter_good, ...)."""
    import json
    meta = json.loads((trained_fixtures / "fixtures.json").read_text())
    return {k: trained_fixtures / v for k, v in meta["paths"].items() if isinstance(v, str)}


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared, loaded box: two OpenMP threads spin-wait far longer than one computes (a module
    uses it by `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def random_eval_inputs(tmp_path_factory):
    """A tiny random-init Qwen3 target, a 2-prompt cache extracted from it, a random z-lab drafter: the real
    eval's inputs in seconds (numbers meaningless, every code path real)."""
    import json
    import random

    import torch

    from remote_payload.__main__ import main as payload_main
    from remote_payload.tools import fixtures
    from tests.tiny_models import random_drafter, tiny_drafter_config, write_zlab_drafter
    d = tmp_path_factory.mktemp("eval-inputs")
    tok = fixtures.train_tokenizer(random.Random(0))
    torch.manual_seed(0)
    r = fixtures.Recipe()
    fixtures.save_target(fixtures.make_target(r, tok.get_vocab_size(), tok.token_to_id("<|eos|>"),
                                              tok.token_to_id("<|pad|>")), tok, d / "target")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"name": n, "prompt": p}) + "\n"
                                             for n, p in fixtures.PROMPTS[:2]))
    assert payload_main(["extract", "--target", str(d / "target"), "--prompts", str(d / "prompts.jsonl"),
                         "--out", str(d / "cache"), "--max-new-tokens", "40", "--layers", "1,3",
                         "--device", "cpu"]) == 0
    cfg = tiny_drafter_config(hidden_size=r.hidden_size, vocab_size=tok.get_vocab_size(),
                              num_target_layers=r.target_layers, mask_token_id=tok.token_to_id("<|mask|>"),
                              target_layer_ids=[1, 3])
    write_zlab_drafter(d / "drafter", cfg, random_drafter(cfg).state_dict())
    return d


@pytest.fixture
def runs_here(tmp_path, monkeypatch):
    """REVAL_RUNS_DIR in the test's tmp dir (<tmp>/local-runs): local copies of runs and follow state stay there.
    A module that launches runs uses it for every test: pytestmark = pytest.mark.usefixtures("runs_here")."""
    monkeypatch.setenv("REVAL_RUNS_DIR", str(tmp_path / "local-runs"))


@pytest.fixture
def st_file(tmp_path):
    """A safetensors file holding tests.samples.sample_tensors() (every dtype, scalars, empties)."""
    from safetensors.torch import save_file

    from tests.samples import sample_tensors
    path = tmp_path / "w.safetensors"
    save_file(sample_tensors(), path, metadata={"format": "pt"})
    return path


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A fresh current directory: built-in `local` host (workdir .reval/local), local registry runs/."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REVAL_HOSTS", raising=False)
    monkeypatch.delenv("REVAL_RUNS_DIR", raising=False)
    return tmp_path


# --- every results.json the suite writes goes through the schema (results engineer) ----------------------
def check_results_roundtrip(path) -> str | None:
    """None when `path` loads through remote_payload.contract.results and writes back every value it holds (exactly,
    for files of the current schema); else why not."""
    import json
    from pathlib import Path

    from remote_payload.contract import results

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        res = results.Result.from_dict(data, source=path)
    except (OSError, ValueError) as e:
        return str(e)
    out = res.to_dict()
    if results.Result.from_dict(out) != res:
        return f"{path}: load(dump(x)) != x"
    if data.get("schema") == results.SCHEMA and out != data:
        return f"{path}: written back differently"
    lost = _not_kept(data, out)
    return f"{path}: {lost} not kept" if lost else None


def _not_kept(data, out, where="") -> str | None:
    """The first value of `data` that `out` does not hold (out may add fields: defaults of optional ones)."""
    if isinstance(data, dict) and isinstance(out, dict):
        for k, v in data.items():
            if k not in out:
                return f"{where}.{k}".lstrip(".")
            if (lost := _not_kept(v, out[k], f"{where}.{k}")) is not None:
                return lost
        return None
    if isinstance(data, list) and isinstance(out, list) and len(data) == len(out):
        return next((lost for i, (a, b) in enumerate(zip(data, out))
                     if (lost := _not_kept(a, b, f"{where}[{i}]")) is not None), None)
    return None if data == out and type(data) is type(out) else (where.lstrip(".") or "(top level)")


@pytest.fixture(autouse=True, scope="session")
def _every_results_json_roundtrips(tmp_path_factory):
    """After the session: every results.json under pytest's tmp dirs (evals, dummy runs, pulled runs, sweeps,
    synthetic ones) round-trips through the schema; a failure is reported as an error of the last test."""
    yield
    bad = []
    for root, _dirs, files in os.walk(tmp_path_factory.getbasetemp()):
        if "results.json" in files and os.path.isfile(os.path.join(root, "results.json")):  # not a test's FIFO
            why = check_results_roundtrip(os.path.join(root, "results.json"))
            if why:
                bad.append(why)
    assert not bad, ("results.json files that do not round-trip through remote_payload/contract/results.py:\n"
                     + "\n".join(bad))
