"""
lora.py: LoRA adapters for dapo.py's policy (--lora-rank r, --lora-alpha α), in the file rather than from
peft: a linear layer keeps its name and its weight, so a Hugging Face checkpoint loads into it as it is,
FSDP2 shards the adapters like any parameter, and the weight sync and the export merge them,
W + (α / r) B A, into the tensors vLLM and transformers already read.

Every nn.Linear of the decoder layers gets A (r x in, Kaiming-uniform, as peft initialises it) and B
(out x r, zeros: the adapted model starts as the base); the base weights are frozen.
"""

import contextlib
import math

import torch
import torch.nn.functional as F

from lib.check_data import InputError

OFF = [False]  # adapters_off(): the base model alone, for --kl-coef's reference


class LoRALinear(torch.nn.Linear):
    """nn.Linear plus (α / r) B A x: the class an adapted layer is given (its state is the layer's own)."""

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        if OFF[0]:
            return out
        return out + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scale


def add_adapters(model, rank, alpha):
    """Adapters on every nn.Linear of model.model.layers (on the meta device, before sharding); the rest of
    the model frozen. Returns the adapted layers' names."""
    names = []
    model.requires_grad_(False)
    for name, m in model.model.layers.named_modules():
        if type(m) is torch.nn.Linear:
            kw = dict(device=m.weight.device, dtype=m.weight.dtype)
            m.lora_A = torch.nn.Parameter(torch.empty(rank, m.in_features, **kw))
            m.lora_B = torch.nn.Parameter(torch.empty(m.out_features, rank, **kw))
            m.lora_scale = alpha / rank
            m.__class__ = LoRALinear
            names.append(f"model.layers.{name}")
    if not names:
        raise InputError("--lora-rank: the model has no nn.Linear in model.model.layers to adapt; "
                         "train it without --lora-rank")
    return names


def init_adapters(model, seed):
    """A Kaiming-uniform, B zero, the same on every rank whatever the sharding (each rank draws the full
    tensor from one seed and keeps its shard); only where load_policy loads the base weights, not on resume."""
    from torch.distributed.tensor import distribute_tensor
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_A"):
                bound = 1 / math.sqrt(p.shape[1])   # kaiming_uniform_(a=sqrt(5)), as nn.Linear and peft
                full = torch.empty(p.shape).uniform_(-bound, bound, generator=g)
            elif name.endswith(".lora_B"):
                full = torch.zeros(p.shape)
            else:
                continue
            local = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)


@contextlib.contextmanager
def adapters_off():
    """The base model alone inside this block (--kl-coef's reference: the initial policy). No gradient: a
    checkpointed layer recomputed in backward would read the flag as it is then."""
    assert not torch.is_grad_enabled()
    OFF[0] = True
    try:
        yield
    finally:
        OFF[0] = False


def full_weight(state_dict, name, gather, dtype, scale):
    """The full tensor the engine and the export read for `name`: an adapted layer's weight with its adapters
    merged, W + scale B A (in fp32, then cast to dtype), any other as it is. gather(t, dtype) makes a full
    tensor of a shard: a collective, so every rank calls this for the same names in the same order."""
    prefix = name[:-len("weight")]
    if not name.endswith(".weight") or prefix + "lora_A" not in state_dict:
        return gather(state_dict[name], dtype)
    a, b, w = (gather(state_dict[prefix + k], torch.float32) for k in ("lora_A", "lora_B", "weight"))
    return torch.addmm(w, b, a, alpha=scale).to(dtype)   # not in place: w may be the parameter itself


def is_adapter(name):
    return name.endswith((".lora_A", ".lora_B"))
