"""Mutation check: turn one feature into a no-op at a time and require the default suite to notice.

    python -m tests.mutations            # every mutation (about 10 minutes on 2 CPU cores)
    python -m tests.mutations ckpt zero2 # some of them
    python -m tests.mutations --list

Each mutation edits one snippet of a copy of the repository (the snippet must occur exactly once,
else the mutation is reported ``stale``: the code moved and the mutation must follow it), then runs
the default tests that should catch it in that copy (``-m 'not slow'``, stop at the first failure).
``killed``: a test went red, as it must. ``SURVIVED``: the feature can be removed with the tests
green; the exit code is then 1. The last results are in ``tests/README.md``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EFFECTS = "tests/unit/test_strategy_effects.py"


@dataclass
class Mutation:
    name: str
    path: str  # relative to the repository
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (default suite) expected to go red


def effect(name: str) -> str:
    return f"{EFFECTS}::test_strategy_changes_what_it_exists_for[{name}]"


def effect2(name: str) -> str:
    return f"{EFFECTS}::test_two_rank_strategy_changes_what_it_exists_for[{name}]"


MUTATIONS = [
    Mutation("flash_attn", "memopt/strategies/flash_attn.py",
             '            model.set_slot(i, "attention_core", FlashCore())', "            pass",
             (effect("flash_attn"), "tests/kernels/test_flash_strategy.py")),
    Mutation("ckpt", "memopt/strategies/ckpt.py",
             "x = checkpoint(_segment_forward, list(blocks[i : i + self.k]), holder, self.tracker, *extra,\n"
             "                           use_reentrant=False, preserve_rng_state=True)",
             "x = _segment_forward(list(blocks[i : i + self.k]), holder, self.tracker, *extra)",
             (effect("ckpt"), "tests/unit/test_strategy_parity.py")),
    Mutation("ckpt_selective", "memopt/strategies/ckpt.py",
             "return checkpoint(self._run, q, k, v, use_reentrant=False, preserve_rng_state=True)",
             "return self._run(q, k, v)", ("tests/unit/test_strategy_memory.py",)),
    Mutation("act_offload", "memopt/strategies/act_offload.py",
             "runner.offload = HostOffload(a.pin_memory, build.tracker)", "runner.offload = None",
             (effect("act_offload"),)),
    Mutation("chunked_loss", "memopt/strategies/chunked_loss.py",
             "model.loss_head = ChunkedLoss(opts.chunk_tokens)", "pass", (effect("chunked_loss"),)),
    Mutation("moe", "memopt/strategies/moe.py",
             "_install(model, c, build.cfg.model, ep=build.dims.ep, stats=RoutingStats(c.num_experts, build.dims.dp))",
             "pass", (effect("moe"),)),
    Mutation("tp", "memopt/strategies/tp.py",
             "        parallelize_module(model, dim.mesh, plan)\n",
             "        return\n", (effect2("tp"),)),
    Mutation("compile_remat", "memopt/strategies/compile.py",
             "self.eager, self.tracker, self.remat = eager, tracker, REMAT[opts.remat]",
             "self.eager, self.tracker, self.remat = eager, tracker, {}", (effect("compile"),)),
    Mutation("compile_tracker", "memopt/strategies/compile.py",
             "        tracker.count(t)\n        return t if outer_pack", "        return t if outer_pack", (effect("compile"),)),
    Mutation("ps_pull", "memopt/engines/ps.py",
             "dist.recv(g.full, src=self._rank(SERVER), group=self.world.group)",
             "dist.recv(g.full.clone(), src=self._rank(SERVER), group=self.world.group)",
             ("tests/distributed/test_ps.py::test_ps_follows_ddp_and_the_single_process",)),
    Mutation("ddp", "memopt/engines/memopt/flat.py",
             "work = self.ctx.all_reduce(flat, async_op=async_op)", "work = None", (effect2("ddp"),)),
    Mutation("zero1", "memopt/engines/memopt/flat.py",
             "self.sharded = stage >= 1 and W > 1", "self.sharded = stage >= 2 and W > 1", (effect2("zero1"),)),
    Mutation("zero2", "memopt/engines/memopt/flat.py",
             "                        flat[off : off + n].copy_(p.grad.reshape(-1))\n                        p.grad = None\n",
             "                        flat[off : off + n].copy_(p.grad.reshape(-1))\n",
             (effect2("zero2"), "tests/distributed/test_zero_parity.py")),
    Mutation("zero3", "memopt/engines/memopt/flat.py",
             "        if self.stage == 3 and self.full is not None:\n            if self.gather_work",
             "        if False and self.full is not None:\n            if self.gather_work",
             (effect2("zero3"), "tests/distributed/test_zero_parity.py")),
    Mutation("cpu_offload", "memopt/engines/memopt/flat.py",
             "        if self.host_grad is not None:  # cpu_offload",
             "        if False:  # cpu_offload",
             (effect("cpu_offload"),)),
    Mutation("offload_param", "memopt/engines/memopt/flat.py",
             "self.param_host = param_host and stage == 3", "self.param_host = False",
             (effect2("cpu_offload.offload_param"),)),
    Mutation("chunk_release", "memopt/engines/chunk/chunk.py",
             '        for attr, w in (("dev", DEVICE), ("host", HOST), ("grad_dev", DEVICE), ("grad_host", HOST)):\n'
             "            self._drop(attr, w)\n",
             '        for attr, w in ():\n            self._drop(attr, w)\n',
             (effect2("chunk.two_ranks"), "tests/chunk/test_chunk_dist.py")),
    Mutation("mem_cache", "memopt/engines/chunk/comm.py",
             "keep = self.cache_size > 0", "keep = False", (effect2("chunk.mem_cache"),)),
    Mutation("static_partition", "memopt/engines/chunk/engine.py",
             "warmup, s.static_partition is not None, tracer", "warmup, False, tracer",
             (effect("static_partition"),)),
    Mutation("pipeline_tied", "memopt/engines/pipeline/engine.py",
             "if self.embed_group is not None and (self.is_first or self.is_last):",
             "if False:", ("tests/pipeline/test_pipeline.py::test_schedule_follows_single_process",)),
    Mutation("pipeline_norm", "memopt/engines/pipeline/engine.py",
             "tracker, pp=pp)", "tracker, pp=None)",
             ("tests/pipeline/test_pipeline.py::test_schedule_follows_single_process",)),
    Mutation("pipeline_tied_norm", "memopt/engines/pipeline/engine.py",
             'g.norm_elsewhere = gname == "tied_head"', "g.norm_elsewhere = False",
             ("tests/pipeline/test_pipeline.py::test_schedule_follows_single_process",)),
    Mutation("auto_pp_batch", "memopt/planner/search_pp.py",  # the pipeline's ranks share the micro-batches
             "accum = max(1, global_mb * pp // mb)", "accum = max(1, global_mb // mb)",
             ("tests/planner/test_search_pp.py::test_pp_candidates_keep_the_global_batch_and_the_pipelines_rules",)),
]


def copy_repo(dst: str) -> None:
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "outputs", "multirun", "wandb")
    for name in ("memopt", "conf", "tests"):
        shutil.copytree(os.path.join(REPO, name), os.path.join(dst, name), ignore=skip)
    shutil.copy(os.path.join(REPO, "pyproject.toml"), dst)


def run(m: Mutation, timeout: float) -> tuple[str, float, str]:
    """(outcome, seconds, last line of pytest's output) of one mutation."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        copy_repo(tmp)
        path = os.path.join(tmp, m.path)
        with open(path) as f:
            text = f.read()
        if text.count(m.old) != 1:
            return "stale", 0.0, f"{m.path}: the snippet occurs {text.count(m.old)} times (the code moved)"
        with open(path, "w") as f:
            f.write(text.replace(m.old, m.new))
        env = {**os.environ, "PYTHONPATH": tmp}
        t0 = time.time()
        try:
            out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", *m.tests], cwd=tmp,
                                 env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", time.time() - t0, f"no result in {timeout:.0f} s"
        lines = [ln for ln in out.stdout.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else out.stderr.strip()[-200:]
        if out.returncode == 1:
            return "killed", time.time() - t0, last
        if out.returncode == 0:
            return "SURVIVED", time.time() - t0, last
        return f"error (pytest exit {out.returncode})", time.time() - t0, last


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutation")
    a = ap.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    if a.list:
        print("\n".join(f"{m.name:18} {m.path}" for m in MUTATIONS))
        return 0
    unknown = [n for n in a.names if n not in known]
    if unknown:
        ap.error(f"unknown mutation(s) {unknown}; known: {', '.join(known)}")
    bad = 0
    for m in [known[n] for n in a.names] or MUTATIONS:
        outcome, secs, last = run(m, a.timeout)
        bad += outcome != "killed"
        print(f"{m.name:18} {outcome:10} {secs:6.0f} s  {last}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
