"""The planner: every rank's peak bytes by category, predicted by running the run's own code on fake tensors.

The core, one path for every engine:
    simulate.py     one rank's build + training step under FakeTensorMode, other ranks a fake process group
    extrapolate.py  deep models from three shallow ones (checked; block by block where the checks fail)
    plan.py         the ranks that bound the world, the fit against a hardware profile, the step time, the table
    placement.py    Hybrid Adam's optimizer groups on the device from step 0, decided by the plan
    preflight.py    plan before a run, refuse what does not fit, suggest what would
    search.py       ``+strategy=auto``: every candidate planned, ranked by predicted step time
    trials.py       ``strategy.auto.trials``: the fastest predicted few trained a few steps, the first by plan and
                    trial runs
    search_pp.py    the pipeline's candidates (pp sizes and schedules a run can take)
    candidate.py    a candidate as typed data: its TrainConfig copy and the overrides it prints
    prune.py        auto's smaller micro-batches skipped once a larger one fits; candidates bounded by their compute
    balance.py      ``strategy.pipeline.split=balanced``: the split with the least largest stage peak
    cpu_rates/      this CPU's step-time rates, measured for plan mode and auto
    figure.py       plan.png
Beside it, what makes a plan cheaper or bounds what fake tensors cannot know:
    fast_ops.py     fake views, in-place updates and allocations answered without FakeTensorMode's cache
    routing.py      MoE routing at the case that bounds its bytes
The wing, one entry per engine of ``engines.ENGINES`` (``engines/``, looked up by the resolved engine):
    engines/memopt.py     size buckets checked while extrapolating
    engines/chunk/        the chunk engine replayed at depth from a recorded shallow step, its layout and
                          decisions checked where it is extrapolated (depth.py)
    engines/deepspeed/    DeepSpeed planned by its own buffers' rules, its ZeRO-3 fetch, DeepSpeed-MoE
    engines/fsdp2.py      FSDP2's CPU offload copies made explicit on fake tensors
"""
