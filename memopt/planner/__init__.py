"""The planner: every rank's peak bytes by category, predicted by running the run's own code on fake tensors.

    simulate.py   one rank's build + training step under FakeTensorMode, other ranks a fake process group
    extrapolate.py  deep models from three shallow ones (checked; block by block where the checks fail)
    chunk_replay.py the chunk engine at the planned depth, driven by a recorded shallow step's model side
    plan.py       the ranks that bound the world, the fit against a hardware profile, the step time, the table
    figure.py     plan.png
    preflight.py  plan before a run, refuse what does not fit, suggest what would
"""
