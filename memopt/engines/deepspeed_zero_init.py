"""ZeRO-3 parameters partitioned as they are made (``deepspeed.zero.Init``), not after a whole model.

A DeepSpeed user trains a model too large for one device by building it inside ``zero.Init``: each
parameter is partitioned over the data-parallel ranks as soon as its module has made it, so no rank ever
holds the whole model. Given an unpartitioned model, ``deepspeed.initialize`` would partition it too, but
only after every rank has materialised it whole (4 P bytes in fp32). memopt builds its model on ``meta``
and applies the model-phase strategies there, so the same effect is had one parameter at a time: made
whole in DeepSpeed's parameter dtype, filled from the seed (the values every engine starts from), and
handed to DeepSpeed's own conversion, which broadcasts rank 0's values and keeps this rank's partition
(on the host with ``offload_param``). ``initialize`` then finds the parameters partitioned already.
"""
from __future__ import annotations

import torch


def partition_at_init(model, config: dict, dtype: torch.dtype, device: torch.device, seed: int, tracker) -> None:
    """Replace ``model``'s meta parameters by ZeRO-3 partitioned ones (ties kept), one parameter whole at a time."""
    import deepspeed

    names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter's first name, as init_weights
    converter = None
    made: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for key, p in mod._parameters.items():
            if p is None:
                continue
            if id(p) not in made:
                with tracker.category("params"):
                    q = torch.nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=p.requires_grad)
                with tracker.category("temp"), torch.no_grad():
                    q.copy_(model.init_tensor(names[id(p)], tuple(p.shape), seed))
                with tracker.category("params"):
                    if converter is None:  # zero.Init on a module converts its parameters (and, as initialize
                        # would, switches F.linear to DeepSpeed's memory-efficient ZeRO-3 linear)
                        holder = torch.nn.Module()
                        holder.p = q
                        deepspeed.zero.Init(module=holder, config_dict_or_path=config, dtype=dtype)
                        converter = q
                    else:  # a ZeRO parameter converts more of them with its Init's settings
                        converter.convert_to_zero_parameters(param_list=[q])
                made[id(p)] = q
            mod._parameters[key] = made[id(p)]
