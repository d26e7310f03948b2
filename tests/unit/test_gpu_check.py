"""The GPU check's orchestration on a CPU (memopt/gpu_check/): the no-CUDA exit, the writers, the
budget and the error handling of sections, the pytest parser and the wheel install (slow: it may
need the network to fill .whl/ with `make gpu-wheels`)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from memopt.gpu_check import cli, flash, procs, results, runs, section_tests, settings
from memopt.gpu_check.check import Check, SkipSection
from tests.conftest import typed

REPO = settings.REPO
# the GPU machine's Python and platform tags, as `make gpu-wheels` downloads for it
GPU_TAGS = ("--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64")


def _pythonpath() -> str:
    return os.pathsep.join([REPO, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])


def test_no_cuda_prints_one_line_and_exits_0(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=_pythonpath())
    p = subprocess.run([sys.executable, "-m", "memopt.gpu_check", str(out)], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], p.stdout
    assert not out.exists()  # nothing installed, nothing written


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        cli.main(["--sections", "nope", "x"])
    assert e.value.code == 2


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_sections_error_skip_budget(tmp_path):
    clock = FakeClock()
    check = Check(str(tmp_path), budget_s=100, mode="cpu-dry-run", work=str(tmp_path / "work"), clock=clock)

    def ok(c, cap, rec):
        clock.t += 30
        return {"value": 1, "cap_seen": cap}

    def boom(c, cap, rec):
        clock.t += 10
        raise RuntimeError("section exploded")

    def skip(c, cap, rec):
        raise SkipSection("needs a GPU")

    def partial(c, cap, rec):
        clock.t += 50
        return {"_status": "partial", "_note": "2 of 3 cases", "cases": [1, 2]}

    check.run_section("a", ok, cap_s=50)
    check.run_section("b", boom, cap_s=50)
    check.run_section("c", skip, cap_s=50)
    check.run_section("d", partial, cap_s=80)  # cap trimmed by the budget: 100 - 40 - reserve
    check.run_section("e", ok, cap_s=50)  # 10 s left, minus the reserve: under MIN_SECTION_S
    res = check.finish()
    s = res["sections"]
    assert s["a"]["status"] == "ok" and s["a"]["result"]["value"] == 1 and s["a"]["result"]["cap_seen"] == 50
    assert s["b"]["status"] == "error" and "section exploded" in s["b"]["error"] and "traceback" in s["b"]
    assert s["c"]["status"] == "skipped" and s["c"]["reason"] == "needs a GPU"
    assert s["d"]["status"] == "partial" and s["d"]["note"] == "2 of 3 cases" and s["d"]["cap_s"] == 100 - 40 - settings.RESERVE_S
    assert s["e"]["status"] == "skipped" and "global budget spent" in s["e"]["reason"]
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert on_disk["status"] == "done" and list(on_disk["sections"]) == ["a", "b", "c", "d", "e"]
    assert (tmp_path / "gpu_check_logs.txt").exists()


def test_results_written_after_every_section(tmp_path):
    """A section that never returns (killed with the process) still leaves the earlier ones on disk."""
    check = Check(str(tmp_path), budget_s=100, mode="cpu-dry-run", work=str(tmp_path / "w"))
    check.run_section("first", lambda c, cap, rec: {"x": 1}, cap_s=20)

    def running(c, cap, rec):
        on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
        assert on_disk["sections"]["first"]["status"] == "ok"
        assert on_disk["sections"]["second"]["status"] == "running"
        return {}

    check.run_section("second", running, cap_s=20)
    assert check.results["sections"]["second"]["status"] == "ok"


FAKE = {
    "schema": 1, "tool": "memopt.gpu_check", "mode": "cuda", "started": "2026-11-26T14:05:00+00:00", "finished": None,
    "budget_s": 360.0, "elapsed_s": 300.0, "status": "done",
    "sections": {
        "env": {"status": "ok", "seconds": 3.0, "result": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130",
                                                             "triton": "3.6.0", "python": "3.12.3", "import_memopt_train": "ok"}},
        "tests": {"status": "partial", "seconds": 80.0, "result": {"kernels_compiled": {
            "counts": {"passed": 90, "failed": 1, "skipped": 2}, "failures": ["FAILED tests/kernels/x.py::t - AssertionError: boom"],
            "last_line": "1 failed, 90 passed, 2 skipped in 70.00s", "rc": 1}}},
        "flash": {"status": "ok", "seconds": 60.0, "result": {"cases": [
            {"dtype": "bfloat16", "head_dim": 128, "n": 4096, "batch_heads": 32,
             "memopt": {"fwd_ms": 1.0, "fwdbwd_ms": 3.0, "fwdbwd_tflops": 200.0, "peak_bytes": 2**27,
                        "max_abs_err": {"out": 1e-3, "dq": 2e-3, "dk": 2e-3, "dv": 1e-3}},
             "sdpa": {"fwd_ms": 0.8, "fwdbwd_ms": 2.5, "fwdbwd_tflops": 250.0, "peak_bytes": 2**27,
                      "max_abs_err": {"out": 1e-3, "dq": 2e-3, "dk": 2e-3, "dv": 1e-3}}},
            {"dtype": "float16", "head_dim": 64, "n": 16384, "error": "not run: the section's cap was reached"}]}},
        "compositions": {"status": "ok", "seconds": 100.0, "result": {"runs": [
            {"name": "plain_bf16", "status": "ok", "planned_device_bytes": 11 * 2**30, "tracker_device_bytes": 10.9 * 2**30,
             "rel_err_tracker": 0.009, "allocator_peak_bytes": 11.5 * 2**30, "rel_err_allocator": -0.04,
             "planned_step_s": 0.017, "step_time_s": 0.05, "rel_err_step_time": -0.66, "tokens_per_s": 160000, "mfu": 0.3}],
            "zero_offload": {"engine": "memopt", "step_time_s": 0.4, "optim_step_s": 0.3, "note": "memopt alone"}}},
        "throughput": {"status": "skipped", "seconds": 0.0, "reason": "global budget spent"},
    },
}


def test_writers_documented_structure(tmp_path):
    results.write_results(str(tmp_path), FAKE)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data == json.loads(json.dumps(FAKE))
    assert set(data) >= {"schema", "mode", "started", "finished", "budget_s", "elapsed_s", "status", "sections"}
    for s in data["sections"].values():
        assert s["status"] in ("ok", "partial", "error", "timeout", "skipped", "running") and "seconds" in s
    txt = (tmp_path / "gpu_check.txt").read_text()
    for needle in ("env", "tests", "flash", "compositions", "throughput", "global budget spent", "NVIDIA H100",
                   "passed 90", "FAILED tests/kernels/x.py::t", "bfloat16", "memopt", "sdpa", "not run",
                   "plain_bf16", "+0.9%", "-4.0%", "-66.0%", "ZeRO-Offload", "memopt alone"):
        assert needle in txt, needle
    assert os.listdir(tmp_path) == ["gpu_check.json", "gpu_check.txt"] or sorted(os.listdir(tmp_path)) == ["gpu_check.json", "gpu_check.txt"]
    results.format_text(results.new_results(10, "cuda"))  # an empty record formats too


def test_cpu_dry_run_skips_the_cuda_sections_with_a_reason(tmp_path):
    res = cli.run_check(str(tmp_path), budget_s=60, mode="cpu-dry-run", sections=("tests", "flash"))
    for name in ("tests", "flash"):
        s = res["sections"][name]
        assert s["status"] == "skipped" and "no CUDA device" in s["reason"], s
    assert res["status"] == "done" and res["finished"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["flash"]["status"] == "skipped"


def test_parse_pytest_output():
    text = """\
tests/kernels/test_a.py::test_one PASSED                                [ 25%]
tests/kernels/test_a.py::test_two[64-True] FAILED                       [ 50%]
tests/kernels/test_a.py::test_three SKIPPED (no gpu)                    [ 75%]
tests/kernels/test_b.py::test_four ERROR                                [100%]
=========================== short test summary info ============================
FAILED tests/kernels/test_a.py::test_two[64-True] - AssertionError: Tensor-likes are not close!
ERROR tests/kernels/test_b.py::test_four - RuntimeError: CUDA error
============= 1 failed, 1 passed, 1 skipped, 1 error in 12.34s =============
"""
    r = section_tests.parse_pytest(text)
    assert r["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert r["failures"][0].startswith("FAILED tests/kernels/test_a.py::test_two[64-True] - AssertionError")
    assert len(r["failures"]) == 2
    assert r["last_line"] == "1 failed, 1 passed, 1 skipped, 1 error in 12.34s"
    xdist = section_tests.parse_pytest("[gw0] [ 50%] PASSED tests/a.py::t1 \n[gw1] [100%] FAILED tests/a.py::t2[x] \n"
                            "FAILED tests/a.py::t2[x] - boom")
    assert xdist["counts"] == {"passed": 1, "failed": 1} and xdist["failures"] == ["FAILED tests/a.py::t2[x] - boom"]
    partial = section_tests.parse_pytest("\n".join(text.splitlines()[:2]))  # cut off by the cap
    assert partial["counts"] == {"passed": 1, "failed": 1} and partial["last_line"] == ""


def test_cuda_marked_tests_are_found():
    # the kernels' file (which the check runs whole, so the default excludes it) and the chunk engine's CUDA staging
    assert section_tests.cuda_marked_test_files(exclude="nothing-excluded") == ["tests/chunk/test_chunk_cuda.py",
                                                                      "tests/kernels/test_flash_attn.py"]
    assert section_tests.cuda_marked_test_files() == ["tests/chunk/test_chunk_cuda.py"]


def test_flash_cases_and_flops():
    cases = flash.flash_cases()
    assert len(cases) == 12 and {c[0] for c in cases} == {"float16", "bfloat16"} and {c[1] for c in cases} == {64, 128}
    assert {c[2] for c in cases} == {1024, 4096, 16384}
    fwd, fb = flash.causal_flops(1, 1, 1024, 64)
    assert fwd == 2 * 1024 * 1024 * 64 and fb == 3.5 * fwd


def test_compositions_compose():
    """Every composition the check trains composes and validates (as the CLI would, on this machine)."""
    from memopt.config import to_dataclass, validate
    from tests.conftest import compose

    for dry in (False, True):
        for name, ov in [*settings.COMPOSITIONS, settings.DEEPSPEED_COMPOSITION]:
            for gpu in (None, "NVIDIA H200", "NVIDIA H100 80GB HBM3"):
                validate(to_dataclass(compose(runs.composition_args(name, ov, dry, gpu))))


def test_each_gpu_plans_with_its_own_profile():
    """An H200 plans as conf/hardware/h200.yaml, an H100 as h100_sxm, another GPU as an H100 (a GH200 too: its
    name holds "H200" only inside a word, and its host link and CPU are not an H200 node's)."""
    from tests.conftest import compose

    for gpu, want in (("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100_sxm"), ("NVIDIA A10G", "h100_sxm"),
                      (None, "h100_sxm"), ("NVIDIA H200 NVL", "h200"), ("NVIDIA GH200 480GB", "h100_sxm"),
                      ("NVIDIA H100 PCIe", "h100_sxm")):
        cfg = compose(runs.composition_args("plain_bf16", ["+strategy=bf16"], False, gpu))
        assert cfg.hardware.name == want and cfg.hardware.host_memory_gb == 120, gpu


@pytest.mark.slow
def test_wheels_install_into_a_fresh_target_and_import(tmp_path):
    """The dry run of the install on a GPU machine: .whl/ (made by `make gpu-wheels`, which needs the
    network the first time) installed with --no-index into a fresh target, then hydra and omegaconf
    imported from there by a fresh interpreter that has no packages of its own."""
    wheel_dir = os.path.join(REPO, ".whl")
    if not glob.glob(os.path.join(wheel_dir, "*.whl")):
        subprocess.run(["make", "gpu-wheels", f"PYTHON={sys.executable}"], cwd=REPO, check=True, timeout=600)
    target = str(tmp_path / "site")
    saved = (list(sys.path), os.environ.get("PYTHONPATH"))
    try:
        rec = procs.install_wheels(wheel_dir, target, pip_args=GPU_TAGS)  # .whl/ holds its binary wheels too
    finally:
        sys.path[:] = saved[0]
        if saved[1] is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved[1]
    assert rec["rc"] == 0, rec
    assert any(w.startswith("hydra_core") for w in rec["wheels"]) and any(w.startswith("antlr4") for w in rec["wheels"])
    venv = str(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    code = ("import hydra, omegaconf, antlr4; from omegaconf import OmegaConf; "
            "OmegaConf.create({'a': '${b}', 'b': 1}).a == 1 or exit(3); print(hydra.__file__); print(omegaconf.__file__)")
    # the GPU machine has pyyaml and packaging (omegaconf's and hydra's other needs): give the fresh
    # interpreter these two, from this environment, and nothing else
    import packaging
    import yaml

    base = tmp_path / "base"
    base.mkdir()
    for mod in (yaml, packaging):
        os.symlink(os.path.dirname(mod.__file__), base / mod.__name__)
    p = subprocess.run([os.path.join(venv, "bin", "python"), "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": os.pathsep.join([target, str(base)]), "PATH": os.environ.get("PATH", "")})
    assert p.returncode == 0, p.stderr
    assert all(line.startswith(target) for line in p.stdout.split()), p.stdout


@pytest.mark.slow
def test_deepspeed_wheels_import_beside_the_gpu_machines_packages(tmp_path):
    """DeepSpeed's wheels in .whl/ installed into a fresh target import, in a fresh interpreter that has only
    the packages the GPU machine has (torch and its dependencies, numpy, packaging, tqdm, pyyaml): the check's
    ZeRO-Offload comparison needs nothing else, its CPU Adam op included (its build needs ninja: on PATH from
    the target's bin/)."""
    import importlib.util

    wheel_dir = os.path.join(REPO, ".whl")
    if not glob.glob(os.path.join(wheel_dir, "deepspeed-*.whl")):
        subprocess.run(["make", "gpu-wheels"], cwd=REPO, check=True, timeout=900)
    target = str(tmp_path / "site")
    saved = (list(sys.path), os.environ.get("PYTHONPATH"), os.environ.get("PATH"))
    try:
        rec = procs.install_wheels(wheel_dir, target, pip_args=GPU_TAGS)
        path = os.environ["PATH"]
    finally:
        sys.path[:] = saved[0]
        for key, value in (("PYTHONPATH", saved[1]), ("PATH", saved[2])):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    assert rec["rc"] == 0, rec
    assert path.split(os.pathsep)[0] == os.path.join(target, "bin") and os.path.exists(os.path.join(target, "bin", "ninja"))
    base = tmp_path / "base"  # the GPU machine's own packages, from this environment, and nothing else; the carried
    base.mkdir()  # compiled modules (built for its Python 3.12) replaced by this Python's builds of the same packages
    for carried in ("pydantic_core", "msgpack", "psutil"):
        shutil.rmtree(os.path.join(target, carried))
    for name in ("torch", "torchgen", "functorch", "numpy", "numpy.libs", "packaging", "tqdm", "yaml", "sympy", "mpmath",
                 "networkx", "jinja2", "markupsafe", "filelock", "fsspec", "triton", "_yaml", "pydantic_core", "msgpack",
                 "psutil"):
        spec = importlib.util.find_spec(name) if "." not in name else None
        src = (os.path.dirname(spec.origin) if spec and spec.origin and spec.origin.endswith("__init__.py")
               else spec.origin if spec else os.path.join(os.path.dirname(os.path.dirname(torch_dir())), name))
        if src and os.path.exists(src):
            os.symlink(src, base / os.path.basename(src))
    venv = str(tmp_path / "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    code = ("import deepspeed, sys; from deepspeed.ops.adam import DeepSpeedCPUAdam; "
            "assert deepspeed.__file__.startswith(sys.argv[1]), deepspeed.__file__; print(deepspeed.__version__)")
    p = subprocess.run([os.path.join(venv, "bin", "python"), "-c", code, target], capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": os.pathsep.join([target, str(base)]), "PATH": path})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-1] == "0.19.8"


def torch_dir() -> str:
    import torch

    return os.path.dirname(torch.__file__)


@pytest.mark.slow  # 2.4 s; the FlashAttention part's bookkeeping
def test_flash_worker_on_cpu(tmp_path):
    """The flash section's worker, run on a CPU under Triton's interpreter (fp32 and fp16, tiny):
    one JSON line per case, both implementations timed and compared with the fp32 reference."""
    path = tmp_path / "flash.jsonl"
    code = ("import os, sys; os.environ['TRITON_INTERPRET'] = '1'\n"
            "from memopt.gpu_check import flash\n"
            "flash.FLASH_WARMUP, flash.FLASH_REPS = 1, 1\n"
            "flash.flash_worker(sys.argv[1], 120, device='cpu', cases=[('float32', 16, 32), ('float16', 16, 48)], tokens=64)\n")
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=_pythonpath()), cwd=REPO)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["dtype"], r["n"], r["batch_heads"]) for r in recs] == [("float32", 32, 2), ("float16", 48, 1)]
    for r, tol in zip(recs, (1e-5, 1e-2)):
        assert "error" not in r, r
        for impl in ("memopt", "sdpa"):
            m = r[impl]
            assert "error" not in m, (impl, m)
            assert set(m["max_abs_err"]) == {"out", "dq", "dk", "dv"} and max(m["max_abs_err"].values()) < tol, m
            assert m["fwd_ms"] > 0 and m["fwdbwd_ms"] > 0 and m["fwdbwd_tflops"] > 0
        split = r["memopt_host_split"]
        assert split["autograd_host_ms"] > 0 and split["launchers_host_ms"] > 0 and split["python_host_ms"] > 0
    txt = results.format_text({"sections": {"flash": {"status": "ok", "seconds": 1.0, "result": {"cases": recs}}}})
    assert "through autograd / the launchers alone / their Python" in txt


@pytest.mark.slow  # 3.7 s; signals to the check's subprocesses
def test_sigterm_keeps_the_results_and_stops_the_children(tmp_path):
    """A timeout from outside (SIGTERM) while sections run: exit 130, the record says so, the plans
    started in the background are stopped."""
    import signal
    import time

    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "memopt.gpu_check", str(out), "--cpu-dry-run", "--no-install",
                          "--sections", "env,compositions"], cwd=REPO, env=dict(os.environ, PYTHONPATH=_pythonpath()),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    rec = {}
    while time.monotonic() < deadline:
        try:
            rec = json.loads((out / "gpu_check.json").read_text())
        except (OSError, ValueError):
            rec = {}
        if (rec.get("sections", {}).get("compositions") or {}).get("status") == "running":
            break
        time.sleep(0.2)
    assert (rec.get("sections", {}).get("compositions") or {}).get("status") == "running", rec
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 130
    rec = json.loads((out / "gpu_check.json").read_text())
    assert rec["status"].startswith("interrupted by signal") and rec["sections"]["env"]["status"] == "ok"
    logs = (out / "gpu_check_logs.txt").read_text()
    assert "plan_plain_bf16.log" in logs
    time.sleep(1)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert rec["work_dir"] not in ps, [line for line in ps.splitlines() if rec["work_dir"] in line]


def test_step_spread_reads_the_timed_steps(tmp_path):
    """The compositions' step-time spread: steps before the warm-up left out, (max - min) / median of the rest
    (here 0.9, 1.0, 1.2 s after two warm-up steps of 5 s: spread 0.3 / 1.0)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "step_time_s": 5.0}, {"step": 1, "step_time_s": 5.0}, {"step": 2, "step_time_s": 1.2},
        {"step": 3, "step_time_s": 0.9}, {"event": "eval"}, {"step": 4, "step_time_s": 1.0}]))
    got = runs.step_spread(str(path), warmup=2)
    assert got["timed_steps"] == 3
    assert (got["step_time_min_s"], got["step_time_max_s"]) == (0.9, 1.2)
    assert got["step_time_spread"] == pytest.approx(0.3)
    assert runs.step_spread(str(tmp_path / "missing.jsonl"), 2) == {}


def test_throughput_reruns_every_composition_untracked(tmp_path, monkeypatch):
    """Every composition that trained is rerun with the tracker off, plain first then by tracked tokens/s (a failed
    one is not); the plan is compared with the untracked step, and the tracker's cost is the tracked step over it."""
    check = Check(str(tmp_path), budget_s=100, mode="cpu-dry-run", work=str(tmp_path / "w"))
    tracked = [  # name, status, tokens/s, planned and tracked step
        ("plain_bf16", "ok", 100.0, 0.05, 0.06), ("bf16_ckpt", "ok", 80.0, 0.06, 0.08),
        ("zero2_offload", "error", None, 0.2, None), ("chunked_loss", "ok", 120.0, 0.05, 0.07)]
    check.results["sections"]["compositions"] = {"status": "partial", "result": {"runs": [
        {"name": n, "status": s, "tokens_per_s": t, "planned_step_s": p, "step_time_s": m} for n, s, t, p, m in tracked]}}
    untracked = {"plain_bf16": 0.048, "bf16_ckpt": 0.064, "chunked_loss": 0.056}
    calls = []

    def fake_run(c, name, overrides, steps, timeout, extra=()):
        calls.append((name, list(extra)))
        return {"name": name, "status": "ok", "step_time_s": untracked[name.removesuffix("_untracked")]}

    monkeypatch.setattr(runs, "train_run", fake_run)
    res = runs.section_throughput(check, 60.0, {})
    assert [n for n, _ in calls] == ["plain_bf16_untracked", "chunked_loss_untracked", "bf16_ckpt_untracked"]
    assert all(extra == ["trainer.track_memory=false"] for _, extra in calls)
    got = {r["name"]: r for r in res["runs"]}
    for name, _, _, planned, measured in (t for t in tracked if t[1] == "ok"):
        assert got[name]["rel_err_step_time"] == pytest.approx(planned / untracked[name] - 1)
        assert got[name]["tracker_cost"] == pytest.approx(measured / untracked[name] - 1)
    assert res["best_tracked"] == "chunked_loss" and "_status" not in res
    txt = results.format_text({**results.new_results(10, "cuda"), "sections": {"throughput": {"status": "ok", "result": res}}})
    assert "tracker +25.0%" in txt and "err +4.2%" in txt  # plain: 0.06 / 0.048 - 1 and 0.05 / 0.048 - 1


def test_memory_bandwidth_counts_the_bytes_an_add_moves():
    """Two operands read and one result written, 2 bytes each in bf16; the rate is those bytes over the median time."""
    from memopt.gpu_check.section_env import memory_bandwidth

    r = memory_bandwidth("cpu", nbytes=1 << 20, reps=3)
    assert r["bytes_per_op"] == 3 * (1 << 19) * 2 and r["seconds"] > 0


def test_throughput_reruns_both_zero_offloads_after_plain_and_compares_them(tmp_path, monkeypatch):
    """memopt's and DeepSpeed's ZeRO-Offload rerun right after plain (the cap cuts the others first), and memopt's
    untracked speed-up over DeepSpeed is DeepSpeed's untracked step over memopt's."""
    check = Check(str(tmp_path), budget_s=100, mode="cpu-dry-run", work=str(tmp_path / "w"))
    ds = settings.DEEPSPEED_COMPOSITION[0]
    tracked = [("chunked_loss", 120.0), (ds, 20.0), ("plain_bf16", 100.0), ("zero2_offload", 40.0), ("bf16_ckpt", 80.0)]
    check.results["sections"]["compositions"] = {"status": "ok", "result": {"runs": [
        {"name": n, "status": "ok", "tokens_per_s": t, "planned_step_s": 0.1, "step_time_s": 0.2} for n, t in tracked]}}
    check.results["sections"]["env"] = {"status": "ok", "result": {"deepspeed": "ok 0.19.8"}}
    untracked = {"plain_bf16": 0.04, "zero2_offload": 0.15, ds: 0.24, "chunked_loss": 0.05, "bf16_ckpt": 0.048}
    calls = []

    extras = {}
    profile = {"step": 1, "sorted_by": "self_device_us", "top_ops": [{"name": "aten::copy_", "calls": 52, "self_device_us": 41000.0}],
               "phases": {"forward_backward": {"cpu_us": 120000.0, "device_us": 99000.0}, "optimizer_step": {"cpu_us": 170000.0}}}

    def fake_run(c, name, overrides, steps, timeout, extra=()):
        calls.append(name.removesuffix("_untracked"))
        extras[calls[-1]] = list(extra)
        return {"name": name, "status": "ok", "step_time_s": untracked[calls[-1]],
                **({"profile": profile} if calls[-1] == ds else {})}

    monkeypatch.setattr(runs, "train_run", fake_run)
    res = runs.section_throughput(check, 60.0, {})
    assert calls == ["plain_bf16", "zero2_offload", ds, "chunked_loss", "bf16_ckpt"]
    last = f"trainer.profile_step={settings.DRY_TRAIN_STEPS - 1}"  # the two ZeRO-Offloads' last step, profiled
    assert all((last in extras[n]) == (n in ("zero2_offload", ds)) for n in calls), extras
    assert res["zero_offload_untracked"]["memopt_speedup_over_deepspeed"] == pytest.approx(0.24 / 0.15)
    txt = results.format_text({**results.new_results(10, "cuda"), "sections": {"throughput": {"status": "ok", "result": res}}})
    assert "memopt's step 1.60x as fast" in txt
    assert f"{ds} step 1 profiled, ms: forward+backward host 120.0 device 99.0, optimizer step host 170.0 device -" in txt
    assert "most self device: aten::copy_ x52 41.0" in txt


def test_a_run_gets_its_share_but_at_least_its_composition_s_least():
    """1.6x its share of what is left, at least 20 s (45 s for DeepSpeed's, whose engine takes ~15 s to start), never
    more than is left."""
    ds = settings.DEEPSPEED_COMPOSITION[0]
    assert runs.run_timeout("plain_bf16", 100.0, 25.0) == pytest.approx(40.0)
    assert runs.run_timeout("plain_bf16", 100.0, 5.0) == pytest.approx(20.0)
    assert runs.run_timeout(ds, 100.0, 20.0) == pytest.approx(45.0)
    assert runs.run_timeout(ds, 30.0, 20.0) == pytest.approx(30.0)


def _steps_made_of(eff: float, gbps: float) -> tuple[list[dict], list[dict], float]:
    """Steps as the planner's own ``step_time`` prices them on a profile with ``compute_efficiency=eff`` and
    ``memory_gbps=gbps`` (the truth of this test), and the tracked plans as it prices them on the profile the GPU check
    plans with now (no memory rate; one efficiency, plain's whole step). A composition: its FLOPs, memory-bound bytes,
    host-optimizer parameters and copies to the host."""
    from dataclasses import replace

    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import step_time

    cfg = typed(["+strategy=bf16"])
    truth = HardwareConfig(name="gpu", device_memory_gb=80, host_memory_gb=100, peak_tflops={"bf16": 989.0},
                           host_device_gbps=55.0, device_device_gbps=450.0, devices_per_node=1, compute_efficiency=eff,
                           memory_gbps=gbps, host_adam_gparams_s=3.0)
    parts = {"plain_bf16": (16.9e12, 56.5e9, 0, 0), "bf16_ckpt": (22.4e12, 61.3e9, 0, 0),
             "chunked_loss": (16.9e12, 69.4e9, 0, 0), "zero2_offload": (16.9e12, 56.5e9, 3e8, 1.2e9)}
    sims = {n: {"flops": f, "traffic": {"op_bytes": b, "host_optim_params": p, "offload_bytes": o}}
            for n, (f, b, p, o) in parts.items()}
    measured = {n: step_time(cfg, truth, sim)["total_s"] for n, sim in sims.items()}
    e0 = sims["plain_bf16"]["flops"] / (989e12 * measured["plain_bf16"])  # the profile's: plain's whole step
    profile = replace(truth, compute_efficiency=e0, memory_gbps=None)
    tracked = []
    for n, sim in sims.items():
        st = step_time(cfg, profile, sim)
        tracked.append({"name": n, "status": "ok", "planned_op_bytes": sim["traffic"]["op_bytes"],
                        "planned_step_s": st["total_s"], "planned_step_terms": {k: st.get(k) for k in (
                            "compute_s", "compute_efficiency", "offload_s", "comm_s", "optimizer_s", "memory_s")}})
    return tracked, [{"name": n, "status": "ok", "step_time_s": t} for n, t in measured.items()], e0


def test_the_step_time_refit_is_the_planners_step_with_the_rates_the_steps_were_made_with():
    """Steps priced by plan.step_time at an efficiency of 0.6 and 4,000 GB/s: with the measured rate the fit finds 0.6
    and its refit is each of those steps (what the planner gives once the profile holds the two lines), where one
    efficiency planned the byte-heavier chunked_loss fast."""
    from memopt.gpu_check import fit

    tracked, untracked, e0 = _steps_made_of(eff=0.6, gbps=4000.0)
    got = fit.step_time_fit(4000.0, tracked, untracked)
    assert got["compute_efficiency"] == pytest.approx(0.6) and got["profile_compute_efficiency"] == pytest.approx(e0)
    rows = {r["name"]: r for r in got["rows"]}
    assert set(rows) == {"plain_bf16", "bf16_ckpt", "chunked_loss", "zero2_offload"}
    assert all(r["refit_rel_err"] == pytest.approx(0.0, abs=1e-9) for r in rows.values()), rows
    assert rows["chunked_loss"]["rel_err"] < -0.05 and rows["plain_bf16"]["rel_err"] == pytest.approx(0.0, abs=1e-9)
    txt = results.format_text({**results.new_results(10, "cuda"), "sections": {"throughput": {"status": "ok", "result": {
        "runs": [], "step_time_fit": got}}}})
    assert "memory_gbps 4000, compute_efficiency 0.600" in txt


def test_zero_offloads_shown_copies_are_its_forward_and_backward_over_plains():
    """Plain: 40 ms forward + backward and a 4 ms device optimizer step; ZeRO-Offload: the same 40 ms, 7 ms of copies
    to the host the side stream did not hide, and a 100 ms host optimizer step: 7 of the planned 22 ms shown."""
    from memopt.gpu_check import fit

    tracked = [{"name": "zero2_offload", "planned_step_terms": {"offload_s": 0.022}}]
    untracked = [{"name": "plain_bf16", "status": "ok", "step_time_s": 0.044, "optim_step_s": 0.004},
                 {"name": "zero2_offload", "status": "ok", "step_time_s": 0.147, "optim_step_s": 0.100}]
    got = fit.offload_exposed(tracked, untracked)
    assert got == pytest.approx({"planned_offload_s": 0.022, "shown_s": 0.007, "shown_fraction": 0.007 / 0.022})
    txt = results.format_text({**results.new_results(10, "cuda"), "sections": {"throughput": {"status": "ok", "result": {
        "runs": [], "offload_exposed": got}}}})
    assert "shown 0.0070 s (31.8% of the plan" in txt
    assert fit.offload_exposed(tracked, untracked[1:]) == {}  # no plain step to stand beside


def test_the_refit_says_why_it_cannot_fit():
    """No measured rate, no plain step, or a rate so low that plain's bytes leave its products less time than they
    take at peak: each a reason, never a number."""
    from memopt.gpu_check import fit

    tracked, untracked, _ = _steps_made_of(eff=0.6, gbps=4000.0)
    assert "no measured device memory rate" in fit.step_time_fit(None, tracked, untracked)["error"]
    assert "an efficiency over 1" in fit.step_time_fit(1000.0, tracked, untracked)["error"]  # 56.5 ms of bytes in 45 ms
    no_plain = [r for r in untracked if r["name"] != "plain_bf16"]
    assert "plain_bf16 has no untracked step" in fit.step_time_fit(4000.0, tracked, no_plain)["error"]
    tracked[1]["planned_step_terms"]["attention_efficiency"] = 0.5  # a term this arithmetic does not redo
    assert "does not redo (attention_efficiency)" in fit.step_time_fit(4000.0, tracked, untracked)["error"]
