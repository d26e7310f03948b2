"""+strategy=auto and the largest-model search, against the planner's own fit rule and the run records."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, compose, train, typed


def small_hw(mib: float):
    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import runtime_bytes

    return HardwareConfig(name="small", device_memory_gb=1.0, host_memory_gb=(runtime_bytes() + mib * 2**20) / 2**30,
                          peak_tflops={"fp32": 1.0}, host_device_gbps=1.0, device_device_gbps=1.0, devices_per_node=1,
                          device_is_host=True)


@pytest.mark.slow
def test_auto_ranks_fitting_candidates_and_drops_the_others():
    from memopt.planner.search import search

    base = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=4", "logger=none", "data=synthetic",
            "trainer.save_checkpoint=false", "trainer.eval_every=0"]
    cfg = typed([*base, "+strategy=auto", "strategy.auto.ckpt=[none,full]", "strategy.auto.micro_batch_size=[4]"])
    # 24 MiB: plain gpt_tiny (about 22 MiB at micro-batch 4 with its 8.5 MiB of activations) fits only just;
    # checkpointing leaves room; both ranked by predicted step time, the recomputing one slower (every one planned)
    rows = search(cfg, small_hw(24), prune=False)
    fits = [r for r in rows if r["fits"]]
    assert fits and all(a["step_s"] <= b["step_s"] for a, b in zip(fits, fits[1:]))
    labels = [r["label"] for r in fits]
    assert any("ckpt" in lab for lab in labels), labels
    tight = search(cfg, small_hw(12))  # 12 MiB: only checkpointing (or offload) fits, never the plain run
    assert all("+strategy=[] " not in r["label"] for r in tight if r["fits"]), [r["label"] for r in tight]


@pytest.mark.slow
def test_largest_model_is_the_boundary_of_the_fit(tmp_path):
    from memopt.planner.search import largest_model

    base = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none", "data=synthetic",
            "trainer.save_checkpoint=false", "trainer.eval_every=0"]
    from memopt.planner.placement import plan_placed
    from memopt.planner.plan import limits_of
    from memopt.planner.simulate import PlanOverflow

    hw = small_hw(30)
    n, plan, tried = largest_model(base, hw, lo=1, hi=16)
    assert 1 <= n < 16 and plan["fits"]
    with pytest.raises(PlanOverflow):  # the boundary: one block more overflows the planned memory
        plan_placed(typed([*base, "trainer.mode=plan", f"model.n_layer={n + 1}"]), hw, limits_of(hw, 1))
    # and the answer is true of the run: depth n trained here peaks within the 30 MiB the profile allows
    s = train([*base, f"model.n_layer={n}", "trainer.max_steps=1"], str(tmp_path / "run"))
    assert s["status"] == "ok" and s["peak_bytes"]["0"]["cpu"]["total"] <= 30 * 2**20


def test_largest_model_scans_above_the_bisection_where_fitting_is_not_monotone(monkeypatch):
    """The chunk engine's fit is not monotone in depth (its chunk layout changes with it: measured on
    PatrickStar's node, 60 layers fit, 61-65 do not, 66 does). Against a fit rule of that shape (the
    reference: the set of depths that fit), bisection alone stops at 5 and the scan finds 8."""
    from types import SimpleNamespace as NS

    import memopt.config
    from memopt.planner import search

    fits = {1, 2, 3, 4, 5, 8}
    monkeypatch.setattr(search, "plan_placed", lambda cfg, hw, limits=None: {"fits": cfg.model.n_layer in fits})
    monkeypatch.setattr(memopt.config, "compose_config", lambda ov: ov)  # the command, typed once; each depth set on a copy
    monkeypatch.setattr(memopt.config, "to_dataclass", lambda ov, overrides=None: NS(model=NS(n_layer=0), trainer=NS(nproc_per_node=1)))
    monkeypatch.setattr(memopt.config, "validate", lambda cfg: None)
    base = ["model=gpt_tiny"]
    assert search.largest_model(base, small_hw(30), lo=1, hi=12)[0] == 5
    n, plan, tried = search.largest_model(base, small_hw(30), lo=1, hi=12, scan=4)
    assert n == 8 and plan["fits"] and len({v for v, _, _ in tried}) == len(tried)  # no depth planned twice


@pytest.mark.slow
def test_plan_mode_cli_writes_plan_json_png_and_summary(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "offline"}
    out = subprocess.run([sys.executable, "-m", "memopt.train", "trainer.mode=plan", "logger=none", "model.seq_len=64",
                          "+strategy=zero3", "trainer.nproc_per_node=2", "hardware=v100_patrickstar", f"hydra.run.dir={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.load(open(tmp_path / "plan.json"))
    assert set(plan["peak_bytes"]) == {"0", "1"} and plan["fits"] and plan["step_time"]["dominant"]
    assert os.path.getsize(tmp_path / "plan.png") > 1000
    assert json.load(open(tmp_path / "summary.json"))["status"] == "ok"
    assert "memopt plan:" in out.stdout and "fits, margin" in out.stdout


@pytest.mark.slow
def test_preflight_refuses_gpt_10b_here_with_status_and_exit_code(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "offline"}
    out = subprocess.run([sys.executable, "-m", "memopt.train", "model=gpt_10b", "logger=none", "hardware.host_memory_gb=24",
                          "hardware.device_memory_gb=null", f"hydra.run.dir={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2, out.stderr[-2000:]
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["status"] == "refused" and "params" in summary["error"] and "no composition fits" in summary["error"]


def test_auto_with_moe_searches_every_valid_expert_parallel_size():
    """+strategy=[auto,moe] keeps MoE and its options in every candidate and searches parallel.ep over
    the sizes that divide both the ranks and the experts; ep > 1 never meets cpu_offload (refused with it)."""
    from memopt.planner.search import base_of, candidates

    cmd = ["model=gpt_tiny", "+strategy=[auto,moe]", "strategy.moe.num_experts=6", "trainer.nproc_per_node=4",
           "parallel.ep=2", "logger=none"]
    cfg = typed([*cmd, "strategy.auto.chunk_budget_gb=[0.0]"])
    base = base_of(cfg)  # the command without what the search chooses: no strategy, parallel.ep at its default
    assert base.strategy.selected() == [] and base.parallel.ep == 1 and base.trainer.nproc_per_node == 4
    cands = candidates(cfg, small_hw(64))
    assert all(c.config(base).strategy.moe.num_experts == 6 for c in cands)  # MoE's options carried by every candidate
    rows = [c.overrides() for c in cands]
    eps = {next(o for o in r if o.startswith("parallel.ep=")) for r in rows}
    assert eps == {"parallel.ep=1", "parallel.ep=2"}  # 4 ranks, 6 experts: 1 and 2 divide both (4 does not divide 6)
    assert all(r[0].startswith("+strategy=[moe,") and "strategy.moe.num_experts=6" in r for r in rows)
    for r in rows:
        if "parallel.ep=2" in r:
            assert "cpu_offload" not in r[0], r
    # the chunk engine keeps each ep rank's expert chunks to itself: it is searched at ep=2 too
    assert any("parallel.ep=2" in r and ("hybrid_adam" in r[0] or "chunk" in r[0]) for r in rows)
    dense = typed(["model=gpt_tiny", "+strategy=auto", "trainer.nproc_per_node=4", "logger=none"])
    assert not any(o.startswith("parallel.ep") for c in candidates(dense, small_hw(64)) for o in c.overrides())


def test_auto_refuses_other_strategies_but_allows_moe():
    from memopt.config import validate
    from memopt.errors import ConfigError

    validate(typed(["model=moe_tiny", "+strategy=auto", "logger=none"]))
    with pytest.raises(ConfigError, match="drop zero2"):
        validate(typed(["model=moe_tiny", "+strategy=[auto,zero2]", "trainer.nproc_per_node=2", "logger=none"]))


def _ep(row: dict) -> str:
    return next(o for o in row["overrides"] if o.startswith("parallel.ep="))


@pytest.mark.slow
def test_auto_chooses_expert_parallelism_when_only_it_fits():
    """moe_tiny on 2 ranks under zero2: with ep=2 each rank holds half the experts' parameters, gradients
    and optimizer states, so a node limit between the two plans' peaks leaves ep=2 the only fitting candidate."""
    from memopt.planner.plan import runtime_bytes
    from memopt.planner.search import search

    base = ["model=moe_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none", "data=synthetic",
            "trainer.save_checkpoint=false", "trainer.eval_every=0", "trainer.nproc_per_node=2"]
    auto = ["+strategy=auto", "strategy.auto.ckpt=[none]", "strategy.auto.stage=[zero2]", "strategy.auto.offload=[false]",
            "strategy.auto.chunk_budget_gb=[]", "strategy.auto.micro_batch_size=[2]"]
    cfg = typed([*base, *auto])
    roomy = search(cfg, small_hw(512))
    assert sorted(_ep(r) for r in roomy) == ["parallel.ep=1", "parallel.ep=2"] and all(r["fits"] for r in roomy)
    peak = {_ep(r): r["peak"] for r in roomy}  # the node's bytes (both ranks and their runtime)
    assert peak["parallel.ep=2"] < peak["parallel.ep=1"]
    mid = (peak["parallel.ep=1"] + peak["parallel.ep=2"]) / 2
    tight = search(cfg, small_hw((mid - runtime_bytes()) / 2**20))  # small_hw adds one runtime
    assert [_ep(r) for r in tight if r["fits"]] == ["parallel.ep=2"], [(r["label"], r.get("why")) for r in tight]


def node_hw(nbytes: int):
    """A CPU-only node of 2 ranks with ``nbytes`` of RAM (what a plan's ``peak`` of a fit compares with)."""
    from memopt.memory.hardware import HardwareConfig

    return HardwareConfig(name="node", device_memory_gb=1.0, host_memory_gb=nbytes / 2**30, peak_tflops={"fp32": 1.0},
                          host_device_gbps=1.0, device_device_gbps=1.0, devices_per_node=2, device_is_host=True)


@pytest.mark.slow
def test_auto_searches_tensor_parallelism_on_two_ranks():
    """World of 2: tp=2 with and without sequence / loss parallelism is planned beside data parallelism
    (tp keeps the global batch with twice the accumulation). With room for all, each tp candidate's
    node needs less than ddp's (half the model states per rank); with a limit between ddp's need and
    the smallest tp need, ddp no longer fits and a tp candidate wins."""
    from memopt.planner.search import search

    base = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none", "data=synthetic",
            "trainer.save_checkpoint=false", "trainer.eval_every=0", "trainer.nproc_per_node=2"]
    axes = ["strategy.auto.ckpt=[none]", "strategy.auto.micro_batch_size=[2]", "strategy.auto.stage=[ddp]",
            "strategy.auto.offload=[false]", "strategy.auto.pp=false"]  # pp against ddp: tests/planner/test_search_pp.py
    cfg = typed([*base, "+strategy=auto", *axes])
    rows = search(cfg, node_hw(2**40), prune=False)  # every candidate planned: their peaks compared
    tp = [r for r in rows if "parallel.tp=2" in r["overrides"]]
    assert {(("strategy.tp.sequence_parallel=true" in r["overrides"]), ("strategy.tp.loss_parallel=true" in r["overrides"]))
            for r in tp} == {(False, False), (False, True), (True, False), (True, True)}
    assert all(r["fits"] and "trainer.grad_accum=2" in r["overrides"] for r in tp), tp
    (ddp,) = [r for r in rows if r["overrides"][0] == "+strategy=[ddp]"]
    assert ddp["fits"] and "trainer.grad_accum=1" in ddp["overrides"]
    assert max(r["peak"] for r in tp) < ddp["peak"], (ddp, tp)
    tight = search(cfg, node_hw((min(r["peak"] for r in tp) + ddp["peak"]) // 2))
    assert tight[0]["fits"] and "parallel.tp=2" in tight[0]["overrides"], tight[0]
    assert not [r for r in tight if r["overrides"][0] == "+strategy=[ddp]"][0]["fits"]


def test_auto_searches_tensor_parallelism_for_llama():
    """Llama has a tensor-parallel plan (its grouped-query key/value heads split like the query heads), so
    +strategy=auto on 2 ranks searches tp=2 for it, and none where the key/value heads do not divide by 2
    (n_kv_head=1, which the tp strategy refuses); its tp candidate needs less per rank than ddp, as Megatron's
    split of every Linear says (the searches had left tp to GPT alone)."""
    from memopt.errors import ConfigError
    from memopt.planner.search import candidates, search
    from memopt.strategies.tp import TPStrategy

    base = ["model=llama_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none", "data=synthetic",
            "trainer.save_checkpoint=false", "trainer.eval_every=0", "trainer.nproc_per_node=2", "+strategy=auto",
            "strategy.auto.ckpt=[none]", "strategy.auto.micro_batch_size=[2]", "strategy.auto.stage=[ddp]",
            "strategy.auto.offload=[false]", "strategy.auto.pp=false", "strategy.auto.chunk_budget_gb=[]"]
    tps = lambda cfg: {o for c in candidates(cfg, node_hw(2**40)) for o in c.overrides() if o.startswith("parallel.tp=")} - {"parallel.tp=1"}
    assert tps(typed(base)) == {"parallel.tp=2"}
    one_kv = typed([*base, "model.n_kv_head=1"])
    assert tps(one_kv) == set()
    with pytest.raises(ConfigError, match="n_kv_head=1 is not divisible by parallel.tp=2"):
        TPStrategy().validate(TPStrategy.Config(), typed([*base[:-7], "model.n_kv_head=1", "+strategy=tp", "parallel.tp=2"]))
    rows = search(typed([*base, "strategy.auto.precision=[fp32]"]), node_hw(2**40), prune=False)
    (tp,) = [r for r in rows if "parallel.tp=2" in r["overrides"] and "strategy.tp.sequence_parallel=false" in r["overrides"]
             and "strategy.tp.loss_parallel=false" in r["overrides"]]
    (ddp,) = [r for r in rows if r["overrides"][0] == "+strategy=[ddp]"]
    assert tp["fits"] and ddp["fits"] and tp["peak"] < ddp["peak"], (tp, ddp)


@pytest.mark.parametrize("engine", ["deepspeed", "fsdp2"])
def test_auto_under_another_engine_searches_that_engines_space(engine):
    """engine=deepspeed / fsdp2 +strategy=auto: only the strategies that engine implements (its SUPPORTS
    list, written out here), no chunk engine, tensor parallelism only where the engine has it, and ZeRO-3's
    optimizer offload with and without parameter offload where the engine has both (DeepSpeed; FSDP2 refuses
    the optimizer alone); the engine is kept for every candidate."""
    from memopt.planner.search import candidates

    supports = {"deepspeed": {"ddp", "zero1", "zero2", "zero3", "cpu_offload", "fp16", "bf16", "ckpt"},
                "fsdp2": {"zero2", "zero3", "cpu_offload", "fp16", "bf16", "ckpt", "tp"}}[engine]
    cfg = typed(["model=gpt_tiny", f"engine={engine}", "+strategy=auto", "trainer.nproc_per_node=2",
                 "hardware.device_memory_gb=0.05", "trainer.device=cpu"])
    rows = [c.overrides() for c in candidates(cfg, small_hw(64))]
    sels = [r[0] for r in rows]
    names = [set(s.split("=", 1)[1].strip("[]").split(",")) - {""} for s in sels]
    assert rows and all(n <= supports for n in names), [n - supports for n in names if not n <= supports]
    # FSDP2 offloads on a CUDA device only: on this CPU its search lists no offload candidate (each was refused),
    # planned for a GPU profile it does
    assert any({"zero3", "cpu_offload"} <= n for n in names) == (engine == "deepspeed")
    if engine == "fsdp2":
        gpu = typed(["model=gpt_tiny", "engine=fsdp2", "+strategy=auto", "trainer.nproc_per_node=2", "hardware=a100_80g",
                     "trainer.mode=plan"])
        assert any("cpu_offload" in c.strategies for c in candidates(gpu, small_hw(64)))
    off_only = [r for r in rows if "strategy.cpu_offload.offload_param=false" in r]
    # DeepSpeed offloads the optimizer alone or the parameters too; FSDP2's CPUOffloadPolicy moves both (refused)
    assert (bool(off_only) and all("zero3" in r[0] for r in off_only)) == (engine == "deepspeed"), off_only
    assert any(o.startswith("parallel.tp=2") for r in rows for o in r) == (engine == "fsdp2")
    memopt_rows = [c.overrides() for c in candidates(typed(["model=gpt_tiny", "+strategy=auto", "trainer.nproc_per_node=2"]), small_hw(64))]
    assert any("chunk" in r[0] or "hybrid_adam" in r[0] for r in memopt_rows)  # the chunk engine is memopt's only


@pytest.mark.slow
def test_deepspeed_auto_through_the_cli_trains_its_choice_within_the_budget(tmp_path):
    """As a user checks it: engine=deepspeed +strategy=auto with a device budget plans DeepSpeed's space,
    trains the fastest predicted candidate that fits, and the run's measured device peak per rank is at most
    the budget (the run itself would have ended oom at the crossing)."""
    budget_gb = 0.05
    p = subprocess.run([sys.executable, "-m", "memopt.train", "engine=deepspeed", "+strategy=auto", "model=gpt_tiny",
                        "trainer.nproc_per_node=2", "trainer.max_steps=2", f"hardware.device_memory_gb={budget_gb}",
                        "logger=none", "trainer.progress_bar=false", f"hydra.run.dir={tmp_path}"],
                       env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "ok" and s["engine"] == "deepspeed"
    rows = json.loads((tmp_path / "auto.json").read_text())
    assert rows[0]["fits"] and all("chunk" not in r["label"] for r in rows)
    for rank in ("0", "1"):
        assert s["peak_bytes"][rank]["cpu"]["total"] <= budget_gb * 2**30


def test_search_reports_each_candidate_and_the_best_so_far():
    """The search says how far it is (done / total) and the fastest fitting candidate so far after each plan."""
    from memopt.planner.search import search

    over = ["model=gpt_tiny", "model.seq_len=32", "+strategy=auto", "strategy.auto.ckpt=[none]",
            "strategy.auto.micro_batch_size=[2]", "strategy.auto.offload=[false]"]
    seen = []
    rows = search(typed(over), small_hw(512), progress=lambda d, t, row, best: seen.append((d, t, row, best)))
    assert [d for d, *_ in seen] == list(range(1, len(rows) + 1)) and {t for _, t, *_ in seen} == {len(rows)}
    fitting = [r for _, _, r, _ in seen if r["fits"]]
    assert fitting and seen[-1][3]["step_s"] == min(r["step_s"] for r in fitting) == rows[0]["step_s"]


def test_listing_reads_the_device_peak_per_rank_against_a_device_budget():
    """With a device budget the listing prints each fitting candidate's device peak per rank (what the budget
    limits, what a run's summary reports per rank) apart from the host's per node; one "peak" of the larger
    had printed the node's host bytes beside a device budget they were never held to (1.78 GiB at 0.6)."""
    import re

    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.search import ranked_table, search

    budget = 48 * 2**20
    hw = HardwareConfig(name="cpu-budget", device_memory_gb=budget / 2**30, host_memory_gb=64.0,
                        peak_tflops={"fp32": 1.0}, host_device_gbps=1.0, device_device_gbps=1.0, devices_per_node=1)
    over = ["model=gpt_tiny", "model.seq_len=32", "+strategy=auto", "strategy.auto.ckpt=[none]",
            "strategy.auto.micro_batch_size=[2]", "strategy.auto.precision=[fp32]"]
    rows = search(typed(over), hw)
    fitting = [r for r in rows if r["fits"]]
    assert fitting and all(r["fit_bytes"]["host"] > budget for r in fitting)  # the node's host: the runtime and more
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    printed = [float(v) * units[u] for v, u in re.findall(r"peak ([0-9.]+) (KiB|MiB|GiB) device per rank",
                                                          ranked_table(rows, len(fitting)))]
    assert len(printed) == len(fitting) and all(0 < b <= budget for b in printed), printed
    assert [b for b in printed] == pytest.approx([r["fit_bytes"]["device"] for r in fitting], rel=0.01)
    # the preflight's suggestion reads its peaks the same way
    from memopt.planner.preflight import suggestion

    text = suggestion(typed(["model=gpt_tiny", "model.seq_len=32", "trainer.micro_batch_size=2"]), hw)["text"]
    (value, unit), = re.findall(r"predicted peak ([0-9.]+) (KiB|MiB|GiB) device per rank, [0-9.]+ [KMG]iB host per node", text)
    assert 0 < float(value) * units[unit] <= budget, text


@pytest.mark.slow
def test_search_in_worker_processes_ranks_as_one_process():
    """The candidates planned side by side in worker processes give the rows of the one-process search, in
    the same order (each plan is a function of its overrides alone); pruned, the same winner (which
    candidates a bound skips depends on the order plans finish in)."""
    from memopt.planner.search import PARALLEL_FROM, search

    over = ["model=gpt_tiny", "model.seq_len=32", "+strategy=auto"]
    cfg = typed(over)
    one = search(cfg, small_hw(512), workers=1, prune=False)
    two = search(cfg, small_hw(512), workers=2, prune=False)
    assert len(one) >= PARALLEL_FROM
    keys = ("label", "fits", "step_s", "peak", "why")
    assert [tuple(r.get(k) for k in keys) for r in one] == [tuple(r.get(k) for k in keys) for r in two]
    assert search(cfg, small_hw(512), workers=2)[0]["label"] == one[0]["label"]


@pytest.mark.parametrize("dtypes", [["fp32"], pytest.param(["fp32", "bf16"], marks=pytest.mark.slow)])  # 17 s on AVX2
def test_pruned_search_keeps_the_exhaustive_searchs_winner(dtypes):
    """A composition's smaller micro-batches are not planned once a larger fits, nor a candidate whose step's lower
    bound (its model's own work, its class's compute) is slower than a fitting step (planner/prune.py): against the
    exhaustive search of the same space, the same winner and the same rows for every candidate planned; every
    candidate skipped for its micro-batch predicted no faster than the larger micro-batch of its composition that
    fit, every one skipped for its bound slower than the winner (or not fitting) and planned no faster than its bound."""
    from memopt.planner.search import search

    base = ["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", "trainer.micro_batch_size=4", "logger=none",
            "data=synthetic", "trainer.save_checkpoint=false", "trainer.eval_every=0"]
    cfg = typed([*base, "+strategy=auto", "strategy.auto.ckpt=[none,full]", "strategy.auto.micro_batch_size=[4,2,1]",
                 "strategy.auto.chunk_budget_gb=[]", f"strategy.auto.precision=[{','.join(dtypes)}]"])
    from dataclasses import replace

    # every term the CPU model has, so a smaller micro-batch's extra ops and calls make it slower, not a tie
    # and a peak low enough that compute leads the step (full recomputation's compute alone then exceeds it)
    # with bf16 10x faster (a device, not the host: both searched), fp32's candidates are bounded by bf16's FLOPs
    hw = replace(small_hw(64), memory_gbps=10.0, op_overhead_us=10.0, collective_latency_us=100.0, host_adam_gparams_s=0.5,
                 peak_tflops={"fp32": 0.002, "bf16": 0.02}, device_is_host=len(dtypes) == 1, device_memory_gb=64 / 1024)
    full = {r["label"]: r for r in search(cfg, hw, workers=1, prune=False)}
    pruned = search(cfg, hw, workers=1)
    assert pruned[0]["label"] == min((r for r in full.values() if r["fits"]), key=lambda r: r["step_s"])["label"]
    kinds = {r.get("skipped") for r in pruned}
    if "bf16" in dtypes:  # fp32 bounded without an fp32 plan of the class: none planned at all
        assert all(r.get("skipped") for r in pruned if "bf16" not in r["label"])
    assert {"micro-batch", "bound"} <= kinds, "the space has both kinds (full recomputation is slower)"
    for r in pruned:
        if not r.get("skipped"):
            assert (r["fits"], r.get("step_s")) == (full[r["label"]]["fits"], full[r["label"]].get("step_s")), r["label"]
            continue
        if r["skipped"] == "bound":
            f = full[r["label"]]  # as the exhaustive search planned it: slower than the winner, and than its bound
            assert not f["fits"] or f["step_s"] > pruned[0]["step_s"], r["label"]
            assert f.get("step_s") is None or f["step_s"] >= r["bound_s"], r["label"]
            continue
        comp = [o for o in r["overrides"] if not o.startswith(("trainer.micro_batch_size=", "trainer.grad_accum="))]
        larger = [f for f in pruned if f["fits"] and [o for o in f["overrides"] if not o.startswith(
            ("trainer.micro_batch_size=", "trainer.grad_accum="))] == comp]
        assert len(larger) == 1 and full[r["label"]]["step_s"] > larger[0]["step_s"], r["label"]


def two_rank_space(device_mib: float, stages: str = "[ddp,zero2,zero3]"):
    """gpt_tiny on 2 ranks over a few compositions and micro-batches, and a device of ``device_mib`` MiB."""
    from dataclasses import replace

    cfg = typed(["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", "trainer.micro_batch_size=4", "logger=none",
                 "data=synthetic", "trainer.save_checkpoint=false", "trainer.eval_every=0", "trainer.nproc_per_node=2",
                 "+strategy=auto", "strategy.auto.ckpt=[none]", "strategy.auto.micro_batch_size=[4,2]",
                 f"strategy.auto.stage={stages}", "strategy.auto.offload=[false]", "strategy.auto.chunk_budget_gb=[]",
                 "strategy.auto.precision=[fp32]",
                 "strategy.auto.tp=false", "strategy.auto.pp=false"])
    hw = replace(small_hw(2048), memory_gbps=10.0, op_overhead_us=10.0, collective_latency_us=100.0, host_adam_gparams_s=0.5,
                 peak_tflops={"fp32": 0.002}, device_is_host=False, device_memory_gb=device_mib / 1024)
    return cfg, hw


def test_a_candidate_whose_first_rank_is_slower_than_a_fitting_step_is_not_planned_further(monkeypatch):
    """A plan's step is its slowest rank's, so a candidate whose rank 0 alone steps slower than a fitting candidate's
    whole step cannot win: its other ranks are not simulated. Against the exhaustive search: the same winner, every
    such row's bound at most its whole plan's step and over the winner's, and only rank 0 simulated for it (every
    fitting one: both ranks)."""
    from memopt.planner import extrapolate
    from memopt.planner.search import base_of, search

    cfg, hw = two_rank_space(12)
    key = lambda c: (repr(c.strategy), c.trainer.micro_batch_size)  # noqa: E731 - a typed config's composition
    full = {r["label"]: r for r in search(cfg, hw, workers=1, prune=False)}
    simulated, real = {}, extrapolate.simulate

    def counted(c, rank, *a, **k):
        simulated.setdefault(key(c), []).append(rank)
        return real(c, rank, *a, **k)

    monkeypatch.setattr(extrapolate, "simulate", counted)
    pruned = search(cfg, hw, workers=1)
    winner = min((r for r in full.values() if r["fits"]), key=lambda r: r["step_s"])
    assert pruned[0]["label"] == winner["label"] and pruned[0]["step_s"] == winner["step_s"]
    first = [r for r in pruned if "rank 0's own step" in r.get("why", "")]
    assert first, "the space has a fitting candidate planned after a faster one"
    for r in first:
        f = full[r["label"]]
        assert winner["step_s"] < r["bound_s"] <= f["step_s"], r["label"]
        # rank 0 alone; a smaller micro-batch of its composition after it is not planned at all (never faster)
        assert simulated.get(key(r["candidate"].config(base_of(cfg)))) in ([0], None), r["label"]
    assert any(simulated.get(key(r["candidate"].config(base_of(cfg)))) == [0] for r in first)
    assert all(simulated[key(r["candidate"].config(base_of(cfg)))] == [0, 1] for r in pruned if r["fits"])


def test_a_plan_in_a_worker_stops_at_a_step_to_beat_another_worker_found_after_it_was_sent(monkeypatch):
    """In a worker the step to beat is read after each rank from the value the search shares (``_LIVE``), so a plan
    sent before any candidate fitted stops once one has: its row is a bound, rank 0's own step, over the shared
    step and at most the candidate's whole planned step. The control: with nothing fitting yet (infinite), the
    same candidate is planned whole and fits."""
    import multiprocessing as mp

    from memopt.planner import search as s

    cfg, hw = two_rank_space(12)
    cand, base = s.candidates(cfg, hw)[0], s.base_of(cfg)
    limits = s.limits_of(hw, 2, cfg)
    live = mp.get_context("spawn").Value("d", float("inf"))
    monkeypatch.setattr(s, "_LIVE", [live])
    whole = s.plan_row(cand, base, hw, limits)  # sent before any fit, and none found meanwhile
    assert whole["fits"] and whole["step_s"] > 0, whole.get("why")
    live.value = whole["step_s"] / 10  # another worker's fit, found while this plan ran
    stopped = s.plan_row(cand, base, hw, limits)
    assert stopped["skipped"] == "bound" and "rank 0's own step" in stopped["why"], stopped
    assert live.value < stopped["bound_s"] <= whole["step_s"]
    assert s.plan_row(cand, base, hw, limits, slower_than=whole["step_s"] / 20)["why"].endswith(
        f"({whole['step_s'] / 20:.3g} s)")  # the lower of the sent and the shared step is the one to beat


def test_a_composition_over_while_built_is_over_at_its_smaller_micro_batches():
    """A composition whose largest micro-batch goes over while its engine is built (its states, before any
    micro-batch) is not planned at its smaller ones: each says so, and the exhaustive search, which plans each,
    finds each over too, at the same memory and category."""
    from memopt.planner.search import search

    cfg, hw = two_rank_space(3)
    full = {r["label"]: r for r in search(cfg, hw, workers=1, prune=False)}
    pruned = search(cfg, hw, workers=1)
    inferred = [r for r in pruned if "built before any micro-batch" in r.get("why", "")]
    assert len(inferred) >= 3 and all("trainer.micro_batch_size=2" in r["label"] for r in inferred)
    for r in inferred:
        f = full[r["label"]]
        assert not f["fits"] and f["at_build"] and r["why"].startswith(f["why"]), (r["why"], f["why"])
    # the control: over in its step (DDP's optimizer states, made at the first step), a larger micro-batch says
    # nothing of a smaller one, which is planned, and fits
    cfg, hw = two_rank_space(10)
    ddp = {r["candidate"].value("trainer.micro_batch_size"): r for r in search(cfg, hw, workers=1)
           if r["candidate"].strategies == ("ddp",)}
    assert (ddp[4]["fits"], ddp[4]["at_build"], ddp[2]["fits"]) == (False, False, True), ddp


def test_model_passes_in_worker_processes_bound_as_in_one_process():
    """With worker processes the model passes are made by the workers, the chains that need one waiting for it: the
    one-process search's winner, in a space where the bound decides, and each bound no more than the step the
    one-process search planned for it, where it did (which candidates are bounded can depend on the order plans
    finish in)."""
    from dataclasses import replace

    from memopt.planner.search import PARALLEL_FROM, search

    cfg = typed(["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", "trainer.micro_batch_size=4", "logger=none",
                 "data=synthetic", "trainer.save_checkpoint=false", "trainer.eval_every=0", "+strategy=auto",
                 "strategy.auto.ckpt=[none,full,selective]", "strategy.auto.micro_batch_size=[4,2,1]",
                 "strategy.auto.chunk_budget_gb=[]", "strategy.auto.precision=[fp32]"])
    hw = replace(small_hw(64), memory_gbps=10.0, op_overhead_us=10.0, peak_tflops={"fp32": 0.0005}, device_memory_gb=64 / 1024)
    one, two = search(cfg, hw, workers=1), search(cfg, hw, workers=2)
    full = {r["label"]: r for r in one}
    assert len(one) >= PARALLEL_FROM
    assert two[0]["label"] == one[0]["label"] and two[0]["step_s"] == one[0]["step_s"]
    bounded = [r for r in two if r.get("skipped") == "bound"]
    assert len(bounded) >= 3, "the passes bounded candidates"
    assert all(full[r["label"]].get("step_s") is None or full[r["label"]]["step_s"] >= r["bound_s"] for r in bounded)


@pytest.mark.parametrize("trials", [2, 0])
def test_a_search_with_trials_plans_the_fastest_it_trials(trials):
    """With ``strategy.auto.trials=k`` a candidate is bounded against the k-th fastest fitting step, so the k fastest
    predicted are all planned and trialled: here (one composition per checkpointing policy) the second fastest,
    selective recomputation, has a model bound over the fastest step and is skipped without trials, not with 2."""
    from dataclasses import replace

    from memopt.planner.search import search

    cfg = typed(["model=gpt_tiny", "model.n_layer=2", "model.seq_len=32", "trainer.micro_batch_size=4", "logger=none",
                 "data=synthetic", "trainer.save_checkpoint=false", "trainer.eval_every=0", "+strategy=auto",
                 "strategy.auto.ckpt=[none,full,selective]", "strategy.auto.stage=[ddp]", "strategy.auto.offload=[false]",
                 "strategy.auto.micro_batch_size=[4]", "strategy.auto.chunk_budget_gb=[]", "strategy.auto.precision=[fp32]",
                 f"strategy.auto.trials={trials}"])
    hw = replace(small_hw(64), memory_gbps=10.0, op_overhead_us=10.0, peak_tflops={"fp32": 0.0005}, device_memory_gb=64 / 1024)
    fastest = sorted((r for r in search(cfg, hw, workers=1, prune=False) if r["fits"]), key=lambda r: r["step_s"])
    pruned = search(cfg, hw, workers=1)
    assert len(fastest) == 3 and "selective" in fastest[1]["label"], [r["label"] for r in fastest]
    if trials:
        assert [r["label"] for r in pruned[:2]] == [r["label"] for r in fastest[:2]]
    else:  # the control: without trials the second fastest is bounded, so the test above can fail
        assert [r for r in pruned if r["label"] == fastest[1]["label"]][0].get("skipped") == "bound"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["memopt", "deepspeed", "fsdp2"])
def test_auto_where_nothing_fits_names_the_smallest_budget_that_works(tmp_path, engine):
    """A device budget no candidate meets is refused before anything is allocated, naming the least a
    candidate needs; that budget, given back, is met: the search then fits (plan mode, one rank; DeepSpeed's
    search named none there before its one-rank ZeRO-Offload candidates, FSDP2's none as its offload cannot run
    on a CPU)."""
    import re

    from tests.conftest import cli_main

    base = [f"engine={engine}", "model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none", "data=synthetic",
            "trainer.save_checkpoint=false", "trainer.eval_every=0", "+strategy=auto", "strategy.auto.micro_batch_size=[2]",
            "strategy.auto.chunk_budget_gb=[]", "strategy.auto.ckpt=[none,full]", "trainer.mode=plan"]
    rc = cli_main([*base, "hardware.device_memory_gb=0.001", f"hydra.run.dir={tmp_path / 'a'}"])
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert rc != 0 and summary["status"] == "refused"
    got = re.search(r"hardware.device_memory_gb=([0-9.e-]+) or more", summary["error"])
    assert got, summary["error"]
    need = float(got.group(1))  # rounded up
    assert need > 0.001
    rc = cli_main([*base, f"hardware.device_memory_gb={need}", f"hydra.run.dir={tmp_path / 'b'}"])
    rows = json.loads((tmp_path / "b" / "auto.json").read_text())
    assert rc == 0 and rows[0]["fits"]  # the plan judged its device peak against the budget given back


@pytest.mark.parametrize("engine, offload_stages, plain", [("memopt", [set(), {"zero3"}], []),
                                                            ("deepspeed", [{"zero2"}, {"zero3"}], []),
                                                            ("fsdp2", [{"zero2"}, {"zero3"}], [{"zero2"}, {"zero3"}])])
def test_one_rank_offloads_with_the_stages_that_do_something_there(engine, offload_stages, plain):
    """One rank: a ZeRO stage partitions nothing, so a candidate carries one only to offload: memopt's cpu_offload alone
    (its ZeRO-Offload) and zero3's (parameters on the host too); DeepSpeed's offload needs a stage (zero2: its
    single-GPU ZeRO-Offload; zero3: parameters too). Without offload no candidate names a stage, but under FSDP2,
    which has no plain data parallelism (``fully_shard`` of one rank, zero2 and zero3; every candidate had been
    refused)."""
    from memopt.planner.search import candidates

    gpu = ["hardware=a100_80g", "trainer.mode=plan"] if engine == "fsdp2" else []  # FSDP2 offloads on a CUDA device
    cfg = typed(["model=gpt_tiny", f"engine={engine}", "+strategy=auto", "strategy.auto.chunk_budget_gb=[]", *gpu])
    stages = {"ddp", "zero1", "zero2", "zero3"}
    rows = [set(c.strategies) for c in candidates(cfg, small_hw(64))]
    offload = [r & stages for r in rows if "cpu_offload" in r]
    assert sorted(map(sorted, {frozenset(o) for o in offload})) == sorted(map(sorted, offload_stages))
    without = sorted(map(sorted, {frozenset(r & stages) for r in rows if "cpu_offload" not in r}))
    assert without == (sorted(map(sorted, plain)) if plain else [[]])


def test_auto_micro_batches_divide_the_global_batch():
    """Every candidate trains the command's global batch: default sizes that do not divide it are left out
    (5 x 1: 5 and 1, not 2, which would train 4 samples a step), and a listed one is refused naming those that do."""
    from memopt.errors import ConfigError
    from memopt.planner.search import candidates

    base = ["model=gpt_tiny", "trainer.micro_batch_size=5", "logger=none", "+strategy=auto"]
    cfg = typed(base)
    sizes = {next(int(o.split("=")[1]) for o in c.overrides() if o.startswith("trainer.micro_batch_size=")) for c in candidates(cfg, small_hw(64))}
    assert sizes == {5, 1}
    with pytest.raises(ConfigError, match=r"strategy.auto.micro_batch_size=\[2\].*sizes that do: \[1, 5\]"):
        typed([*base, "strategy.auto.micro_batch_size=[2]"])


def test_fsdp2_offload_is_refused_when_the_plan_is_for_this_cpu():
    """FSDP2's CPU offload cannot run on a CPU (the run is refused). Plan mode still plans it for a GPU profile, but
    not for this CPU's own profile (hardware=auto, a device budget or not): there auto's search in plan mode had
    ranked it first at a budget, and the run it named was refused. They were refused rows after that; now the search
    lists none for this CPU (every one was refused), and lists them for a GPU profile's plan."""
    import torch

    from memopt.config import validate
    from memopt.errors import ConfigError
    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.search import base_of, candidates

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: FSDP2's offload runs here")
    cmd = ["model=gpt_tiny", "engine=fsdp2", "trainer.nproc_per_node=2", "logger=none", "trainer.mode=plan"]
    with pytest.raises(ConfigError, match="cpu_offload with engine=fsdp2 needs a CUDA device"):
        validate(typed([*cmd, "+strategy=[zero2,cpu_offload]", "hardware.device_memory_gb=0.05"]))
    validate(typed([*cmd, "+strategy=[zero2,cpu_offload]", "hardware=a100_80g"]))  # a GPU's plan, made here
    cfg = typed([*cmd, "+strategy=auto", "hardware.device_memory_gb=0.05", "strategy.auto.micro_batch_size=[16]"])
    hw = resolve_hardware(cfg.hardware, torch.device("cpu"))
    assert not [c for c in candidates(cfg, hw) if "cpu_offload" in c.strategies]
    gpu = typed([*cmd, "+strategy=auto", "hardware=a100_80g", "strategy.auto.micro_batch_size=[16]"])
    offload = [c for c in candidates(gpu, hw) if "cpu_offload" in c.strategies]
    assert offload
    with pytest.raises(ConfigError, match="needs a CUDA device"):  # such a candidate with this CPU's profile
        validate(offload[0].config(base_of(cfg)))


def test_auto_refuses_an_engine_that_cannot_run_what_the_command_keeps():
    """engine=fsdp2 does not run MoE, which every candidate of a MoE command keeps: the search is refused
    naming it and the engines that do, before any plan (it had answered "none of 0 candidates fits")."""
    from memopt.errors import ConfigError
    from memopt.planner.search import search

    cfg = typed(["model=moe_tiny", "model.seq_len=32", "engine=fsdp2", "+strategy=auto", "trainer.nproc_per_node=2"])
    with pytest.raises(ConfigError, match=r"engine=fsdp2 \+strategy=auto: the command's moe is not among .* use engine=memopt or engine=deepspeed"):
        search(cfg, small_hw(512))


def test_a_search_refused_by_its_engine_writes_its_record(tmp_path):
    """The job ends at the gate with summary.json saying refused and why (it had ended with Hydra's
    traceback and no record: the fixed-budget table saw "no summary.json" for FSDP2 on moe_small)."""
    from memopt.gate import gate

    ov = ["model=moe_tiny", "model.seq_len=32", "engine=fsdp2", "+strategy=auto", "trainer.nproc_per_node=2",
          "trainer.mode=plan", "logger=none"]
    verdict = gate(compose(ov), str(tmp_path), launched=False)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert verdict.summary["status"] == s["status"] == "refused"
    assert "moe is not among what engine=fsdp2 runs" in s["error"], s


def test_deepspeed_plan_stops_once_its_activations_are_over_what_its_states_leave():
    """DeepSpeed's plan (its rules on memopt's fake step) stops at the fake step's first op whose activations are
    over what the device leaves beside DeepSpeed's states (stages 0-2; stage 3: the whole device): a DeepSpeed run
    holds them there (the same model code: planned activations equal the measured, test_accuracy_deepspeed.py),
    so it could not fit. At the rules' own total the plan runs to its end, with the same bytes."""
    import torch

    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.engines.deepspeed.rules import deepspeed_model_states
    from memopt.planner.plan import make_plan
    from memopt.planner.simulate import PlanOverflow

    cfg = typed(["engine=deepspeed", "+strategy=zero2", "model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=8",
                 "trainer.nproc_per_node=2", "trainer.eval_every=0", "trainer.save_checkpoint=false", "logger=none"])
    hw = resolve_hardware(cfg.hardware, torch.device("cpu"))
    free = make_plan(cfg, hw)
    acts = max(p["device"]["activations"] for p in free["peak_bytes"].values())
    need = max(p["device"]["total"] for p in free["peak_bytes"].values())
    held = deepspeed_model_states(cfg, 2)["device_total"]
    assert 0 < acts and 0 < held and held + acts < need
    with pytest.raises(PlanOverflow) as over:  # in the step: the activations over what the states leave
        make_plan(cfg, hw, {"device": held + acts // 2})
    assert acts // 2 < over.value.live["activations"] <= acts
    with pytest.raises(PlanOverflow) as over:  # before the step: the states alone
        make_plan(cfg, hw, {"device": held - 1})
    assert "activations" not in over.value.live and over.value.total >= held
    # at what the states leave the activations, the rules judge: the same bytes as without a limit
    assert make_plan(cfg, hw, {"device": held + acts})["peak_bytes"] == free["peak_bytes"]
    # (zero3's stop without recomputation: the slow search below)
    # stage 3 with recomputation: the rules' total is taken from the first gradient on, not at the forward's end,
    # so activations over the device do not stop the step there; the rules judge
    ckpt = typed(["engine=deepspeed", "+strategy=[zero3,ckpt]", "model=gpt_tiny", "model.seq_len=64",
                  "trainer.micro_batch_size=8", "trainer.nproc_per_node=2", "trainer.eval_every=0",
                  "trainer.save_checkpoint=false", "logger=none"])
    free = make_plan(ckpt, hw)
    acts = max(p["device"]["activations"] for p in free["peak_bytes"].values())
    assert make_plan(ckpt, hw, {"device": acts // 2})["peak_bytes"] == free["peak_bytes"]


@pytest.mark.slow
def test_deepspeed_search_stopped_at_activations_keeps_every_row(monkeypatch):
    """engine=deepspeed +strategy=auto with the early stops above (the states alone, the activations) against the
    same search whose rules get no limit, as before them: the same fitting rows, winner and steps; every candidate
    stopped early did not fit there."""
    from dataclasses import replace

    from memopt.planner.search import search

    cfg = typed(["engine=deepspeed", "model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=8",
                 "trainer.nproc_per_node=2", "trainer.eval_every=0", "trainer.save_checkpoint=false", "logger=none",
                 "+strategy=auto", "strategy.auto.precision=[fp32]", "strategy.auto.micro_batch_size=[8,2]",
                 "strategy.auto.ckpt=[none]"])
    # the device's stops are under test: a host that holds both ranks whatever this process's resident set (with
    # small_hw's, the runtime plus 512 MiB, nothing fitted after the CLI tests above had grown it)
    hw = replace(small_hw(512), device_is_host=False, device_memory_gb=12 / 1024, host_memory_gb=64.0)
    stopped = search(cfg, hw, workers=1, prune=False)
    import memopt.planner.engines.deepspeed as wing_module  # the reference: the rules without a limit, as before

    rules = wing_module.WING.rules
    monkeypatch.setattr(wing_module, "WING", replace(wing_module.WING, rules=lambda c, r, w, limits, *a, **k: rules(
        c, r, w, None, *a, **k)))
    full = search(cfg, hw, workers=1, prune=False)
    by_label = {r["label"]: r for r in full}
    early = [r for r in stopped if r.get("why") and not by_label[r["label"]].get("why")]
    rows = [(r["label"], r["fits"], r.get("why"), r.get("peak")) for r in stopped]
    assert early and all(not by_label[r["label"]]["fits"] for r in early) and any(r["fits"] for r in stopped), rows
    keys = ("label", "fits", "step_s", "peak")
    assert [tuple(map(r.get, keys)) for r in stopped if r["fits"]] == [tuple(map(r.get, keys)) for r in full if r["fits"]]


@pytest.mark.slow
def test_deepspeed_plan_of_a_deep_model_stops_on_its_extrapolated_activations():
    """A deep model is planned from shallow ones (planner/extrapolate.py): the activations limit is judged on the
    extrapolated peaks there, so the stop above holds at depth too; at what the states leave them, the same bytes."""
    import torch

    from memopt.memory.hardware import resolve_hardware
    from memopt.planner.engines.deepspeed.rules import deepspeed_model_states
    from memopt.planner.plan import make_plan
    from memopt.planner.simulate import PlanOverflow

    cfg = typed(["engine=deepspeed", "+strategy=zero2", "model=gpt_tiny", "model.n_layer=24", "model.seq_len=64",
                 "trainer.micro_batch_size=8", "trainer.nproc_per_node=2", "trainer.eval_every=0",
                 "trainer.save_checkpoint=false", "logger=none"])
    hw = resolve_hardware(cfg.hardware, torch.device("cpu"))
    free = make_plan(cfg, hw)
    assert free["method"]["0"].startswith("extrapolated"), free["method"]
    acts = max(p["device"]["activations"] for p in free["peak_bytes"].values())
    held = deepspeed_model_states(cfg, 2)["device_total"]
    with pytest.raises(PlanOverflow) as over:
        make_plan(cfg, hw, {"device": held + acts // 2})
    assert acts // 2 < over.value.live["activations"] <= acts
    assert make_plan(cfg, hw, {"device": held + acts})["peak_bytes"] == free["peak_bytes"]
