"""float8 training through torchao: the linear layers' matmuls in float8 (tensorwise dynamic scaling, e4m3
forward, e5m2 gradients), everything else as the compute dtype says (bf16).

    from mmm.parallel.float8 import apply_float8
    converted = apply_float8(model)       # the output head ("output", "lm_head", "head") stays in bf16

float8 pays on devices with float8 matmul units (NVIDIA compute capability 8.9+: H100, H200, L40S, B200)
and under ``torch.compile``, which fuses the casts and scales; elsewhere it is refused
(:func:`float8_device_problem`). A linear whose in/out features are not multiples of 16 stays as it
is (the float8 matmul's alignment). Tensor parallel is refused: torchao's float8 TP styles are not
mapped here (:func:`float8_problems`). FSDP all-gathers the bf16 weights (not float8 ones): float8
all-gather would need torchao's scale precompute after every optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mmm.errors import API, Spelling, UsageError

INSTALL_HINT = "pip install torchao (or mmm[float8])"
ALIGN = 16
# the output heads of mmm's models and of Hugging Face's, kept in bf16
HEADS = ("output", "lm_head", "head")


def float8_problems(float8: bool, *, tp: int, dtype: str, strategy: str, spell: Spelling = API) -> list[str]:
    """What float8 cannot honour in these settings (any device)."""
    if not float8:
        return []
    out = []
    if tp > 1:
        out.append(
            f"{spell('float8', True)} with {spell('tp', tp)}: torchao's float8 tensor-parallel styles are not "
            f"mapped; drop {spell.name('float8')} or use tp=1"
        )
    if dtype != "bf16":
        out.append(
            f"{spell('float8', True)} needs {spell('dtype', 'bf16')} (float8 matmuls, bf16 elsewhere); "
            f"got {spell('dtype', dtype)}"
        )
    if strategy.startswith("zero"):
        out.append(
            f"{spell('float8', True)} with {spell('strategy', strategy)}: DeepSpeed owns the dtype; "
            "use fsdp, hsdp or ddp"
        )
    return out


def float8_device_problem(device: torch.device) -> str | None:
    """Why ``device`` cannot train in float8 (None: it can)."""
    if device.type != "cuda":
        return (
            f"--float8 needs a CUDA device with float8 matmuls (compute capability 8.9+: H100, H200, L40S, "
            f"B200); this run's device is {device.type}: drop --float8"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"--float8 needs float8 matmuls (compute capability 8.9+); {name} is {major}.{minor}: drop --float8"
    return None


def _torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise UsageError(f"--float8 needs torchao, which is not installed ({e.name or e}): {INSTALL_HINT}") from None
    return Float8LinearConfig, convert_to_float8_training


def apply_float8(model: nn.Module, *, skip: Sequence[str] = HEADS) -> list[str]:
    """Swap ``model``'s ``nn.Linear`` layers for torchao's ``Float8Linear`` in place, but the output head
    (a module whose own name is in ``skip``), those under a module that keeps fp32 (``keep_fp32``: a
    mixture's router) and those whose features are not multiples of 16. Returns the names converted; a
    model with none is refused (float8 would be silently off)."""
    config_cls, convert = _torchao()
    skipped = set(skip)
    fp32 = [name for name, m in model.named_modules() if getattr(m, "keep_fp32", False)]
    converted: list[str] = []

    def take(module: nn.Module, name: str) -> bool:
        ok = (
            isinstance(module, nn.Linear)
            and name.rsplit(".", 1)[-1] not in skipped
            and not any(name == f or name.startswith(f + ".") for f in fp32)
            and module.in_features % ALIGN == 0
            and module.out_features % ALIGN == 0
        )
        if ok:
            converted.append(name)
        return ok

    convert(model, config=config_cls(), module_filter_fn=take)
    if not converted:
        raise UsageError(
            f"--float8: no linear layer of {type(model).__name__} can run in float8 (features multiples of "
            f"{ALIGN}, not a head {sorted(skipped)}); drop --float8"
        )
    return converted
