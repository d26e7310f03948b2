"""A CPU run keeps freed host blocks (memory/host_malloc.py); the reference is the kernel's own page-fault count.

Each case runs in a subprocess: malloc's settings are the whole process's and stay set.
"""
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")

# Twelve "steps", each making, writing and freeing blocks over glibc's largest mmap threshold (32 MiB; as
# gpt_small's MLP activations at micro-batch 16): the minor page faults of the first step and of the last four.
# Kept blocks settle within a few steps (torch's 64-byte aligned requests do not fit the same-size block
# just freed until the heap has a few to choose from); malloc's defaults fault every step's pages again.
FAULTS = textwrap.dedent("""
    import resource, torch
    def step_faults():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(n) for n in (16 * 2**20, 12 * 2**20, 16 * 2**20)]
        del blocks
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults = [step_faults() for _ in range(12)]
    print("FAULTS", faults[0], sum(faults[-4:]))
""")


def _faults(setup: str, cwd) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", setup + FAULTS], cwd=cwd, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    first, last = out.stdout.split("FAULTS")[-1].split()
    return int(first), int(last)


def test_freed_blocks_are_reused_not_faulted_in_again(tmp_path):
    first, kept = _faults("from memopt.memory import host_malloc\nassert host_malloc.keep_freed_blocks()\n", tmp_path)
    assert first >= 3 * 44 * 2**20 // 2**21, f"writing 176 MiB should fault its pages in: {first} faults"
    assert kept < first / 10, (first, kept)


def test_a_cpu_run_keeps_freed_blocks_unless_told_not_to(tmp_path):
    run = ("from memopt.api import run_job\n"
           "s = run_job(['trainer.max_steps=1', 'logger=none', 'trainer.eval_every=0', 'trainer.progress_bar=false',"
           " 'trainer.save_checkpoint=false', 'trainer.micro_batch_size=2'{extra}], 'run')\n"
           "assert s['cpu_malloc_cache'] is {want}, s.get('cpu_malloc_cache')\n")
    (tmp_path / "on").mkdir(), (tmp_path / "off").mkdir()
    first, kept = _faults(run.format(extra="", want=True), tmp_path / "on")
    _, default = _faults(run.format(extra=", 'trainer.cpu_malloc_cache=false'", want=False), tmp_path / "off")
    assert kept < first / 10 and default >= 3 * first, (first, kept, default)


def test_the_record_says_what_the_process_runs_with(tmp_path):
    """malloc's settings last for the process: a run with the option off after one with it on, in one process,
    runs with freed blocks kept, and its summary.json says so."""
    code = ("from memopt.api import run_job\n"
            "common = ['trainer.max_steps=1', 'logger=none', 'trainer.eval_every=0', 'trainer.progress_bar=false',"
            " 'trainer.save_checkpoint=false', 'trainer.micro_batch_size=2']\n"
            "off = run_job([*common, 'trainer.cpu_malloc_cache=false'], 'off')['cpu_malloc_cache']\n"
            "on = run_job(common, 'on')['cpu_malloc_cache']\n"
            "after = run_job([*common, 'trainer.cpu_malloc_cache=false', 'trainer.overwrite=true'], 'off')['cpu_malloc_cache']\n"
            "print('RECORDS', off, on, after)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("RECORDS")[-1].split() == ["False", "True", "True"], out.stdout[-500:]
