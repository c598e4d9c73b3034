"""Safetensors checkpoints in and out of a sharded model, each rank reading only its part.

    from mmm.parallel.hf_checkpoint import load_safetensors
    model = parallelize(model, mesh, spec, device=dev, seed=0)
    load_safetensors(model, "path/to/checkpoint")           # model.safetensors (or its index + shards)

Every parameter, plain or a DTensor shard (FSDP, TP, both), is filled from a safetensors slice
covering this rank's region of the global tensor: a rank reads its rows/columns, never the whole
checkpoint. A Hugging Face model loads with its own names; a model whose names differ gives a
:class:`Source` per parameter: the checkpoint's name, and for rotary query/key projections the head
size whose rows are permuted from Hugging Face's rotate-half layout (the two halves of a head are
the pairs) to adjacent pairs.

The way out, :func:`export_safetensors`, is the inverse: every rank takes part (DTensor shards are
gathered with ``full_tensor()``; under pipeline parallel, the ranks of rank 0's pipeline send their
stages to it), and rank 0 writes ``model.safetensors`` (+ ``config.json``).

A model's own mapping lives beside the model: mmm's Llama in :mod:`mmm.models.llama.hf`
(``load_hf_llama``, ``export_hf_llama``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mmm.dist.exits import RankZeroFailed, on_rank0
from mmm.errors import RunError, UsageError, first_line, folder_problem
from mmm.files import fsync_path
from mmm.log import get_logger
from mmm.parallel.checkpoint_folder import crash_point, no_space
from mmm.parallel.meta import canonical_name


class Source:
    """Where a parameter comes from: a tensor name in the checkpoint, and for rotary projections the
    head size whose halves are re-interleaved (HF rotate-half -> adjacent pairs)."""

    def __init__(self, key: str, rotary_head_dim: int | None = None) -> None:
        self.key, self.rotary_head_dim = key, rotary_head_dim


def tensor_files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (one file, or an index of shards)."""
    if path.is_file():
        files = [path]
    else:
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                return {str(k): path / str(v) for k, v in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise UsageError(
                    f"{index} is not a safetensors index (a JSON object with a weight_map: {type(e).__name__}: "
                    f"{first_line(e)}); save the checkpoint again with transformers' save_pretrained()"
                ) from None
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UsageError(
            f"no safetensors checkpoint in {path} (expected model.safetensors or "
            "model.safetensors.index.json); save one with transformers' save_pretrained()"
        )
    out = {}
    for f in files:
        with open_safetensors(f) as handle:
            out.update({k: f for k in handle.keys()})
    return out


def open_safetensors(file: Path):
    """``safe_open`` of one file, a file that is missing or not safetensors (cut short, another format)
    refused in one line naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise UsageError(
            f"{file} cannot be read as safetensors ({first_line(e)}); copy or save the checkpoint again"
        ) from None


def local_region(param: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the global tensor this rank holds (all of it for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _unrotate(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF's rotary layout (per head: first half, second half) -> adjacent pairs, on whole heads."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _rotate(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Adjacent pairs -> HF's rotary layout (per head: first half, second half): the inverse of
    :func:`_unrotate`."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _read(handle, source: Source, region: tuple[slice, ...]) -> torch.Tensor:
    part = handle.get_slice(source.key)
    if source.rotary_head_dim is None:
        return part[region] if region else part[:]
    hd = source.rotary_head_dim  # read the whole heads that cover the rows, permute, cut
    rows, rest = region[0], region[1:]
    first, last = rows.start // hd * hd, -(-rows.stop // hd) * hd
    block = _unrotate(part[(slice(first, last), *rest)], hd)
    return block[rows.start - first : rows.stop - first]


@torch.no_grad()
def load_safetensors(
    model: nn.Module,
    path: str | Path,
    *,
    sources: Mapping[str, Source] | None = None,
    rename: Callable[[str], str] | None = None,
) -> list[str]:
    """Fill every parameter of ``model`` (materialised: plain, or DTensor shards) from the safetensors
    checkpoint at ``path``: ``sources[name]`` (or the parameter's own name) says which tensor.
    Shapes are checked; a parameter the checkpoint lacks is an error. Returns the checkpoint's
    tensors nothing took (e.g. ``lm_head.weight`` of a tied model)."""
    from torch.distributed.tensor import DTensor

    path = Path(path)
    where = tensor_files(path)
    plan: dict[Path, list[tuple[torch.Tensor, Source, str]]] = {}
    missing = []
    for name, param in model.named_parameters():
        name = canonical_name(name)
        src = (sources or {}).get(name) or Source(rename(name) if rename else name)
        if src.key not in where:
            missing.append(f"{name} (looked for {src.key})")
            continue
        plan.setdefault(where[src.key], []).append((param, src, name))
    if missing:
        raise UsageError(
            f"{path} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''}"
        )
    for file, items in plan.items():
        with open_safetensors(file) as handle:
            for param, src, name in items:
                shape = tuple(handle.get_slice(src.key).get_shape())
                if shape != tuple(param.shape):
                    raise UsageError(
                        f"{file.name}: {src.key} has shape {list(shape)} but {name} is "
                        f"{list(param.shape)}; the checkpoint is for another configuration"
                    )
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(_read(handle, src, local_region(param)).to(local.dtype))
    taken = {src.key for items in plan.values() for _, src, _ in items}
    return sorted(set(where) - taken)


def read_hf_config(path: str | Path) -> dict:
    """The ``config.json`` of the Hugging Face checkpoint at ``path`` (a directory, or a file in one)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(
            f"{path} does not exist; give a Hugging Face checkpoint directory (config.json + "
            "*.safetensors, as save_pretrained() writes it)"
        )
    file = (path if path.is_dir() else path.parent) / "config.json"
    if not file.exists():
        raise UsageError(f"no config.json in {file.parent}: a Hugging Face checkpoint directory has one")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"{file} is not valid JSON ({err}); restore it from the checkpoint's source") from None
    if not isinstance(config, dict):
        raise UsageError(f"{file} holds {type(config).__name__}, not a Hugging Face config (a JSON object)")
    return config


def export_problems(where: str, out: str | Path, *, keep: Mapping[str, str | Path | None] | None = None) -> list[str]:
    """Why ``out`` cannot take an export (nothing is created). An export replaces its folder whole (what
    the folder held is moved aside, never deleted), so ``out`` must not be, or hold, the current folder
    or any folder in ``keep`` (a description -> a path: the run's output and checkpoint folders), and
    must not hold folders of its own: an export has none, a parent folder of models does."""
    problem = folder_problem(where, out)
    if problem:
        return [problem]
    path = Path(out).resolve()
    held = {"the current folder": Path.cwd(), **{k: v for k, v in (keep or {}).items() if v is not None}}
    for what, folder in held.items():
        folder = Path(folder).resolve()
        if folder.is_relative_to(path):
            same = folder == path
            return [
                f"{where} {'is' if same else 'holds'} {what}, and an export replaces its folder whole (moving what "
                "it held aside): give a folder of its own, e.g. a new one inside the output folder"
            ]
    # an export or a Hugging Face checkpoint (--init-from's weights: config.json, maybe original/ or .cache/)
    # is taken; a folder of other folders is not
    checkpoint = path.is_dir() and (path / "config.json").is_file()
    inner = [] if not path.is_dir() or checkpoint else sorted(p.name for p in path.iterdir() if p.is_dir())
    inner = [n for n in inner if not n.startswith(".")]
    if inner:
        return [
            f"{where} holds folders ({', '.join(map(repr, inner[:3]))}), so it is not an earlier export: an export "
            "replaces its folder whole (moving what it held aside); give a new folder or an earlier export"
        ]
    return []


# --------------------------------------------------------------------------- out
@torch.no_grad()
def export_safetensors(
    model: nn.Module,
    out_dir: str | Path,
    *,
    sources: Mapping[str, Source],
    config: Mapping | None = None,
    pp_group=None,
    dtype: torch.dtype | None = None,
    files: Mapping[str, bytes] | None = None,
) -> Path | None:
    """Write every parameter of ``model`` to ``out_dir/model.safetensors`` under the name
    ``sources[name]`` gives (rows of a rotary :class:`Source` permuted back to rotate-half), and
    ``config`` as ``config.json``, and ``files`` (name -> bytes, e.g. ``tokenizer.json``; rank 0's count)
    beside them, all in the folder before it takes ``out_dir``'s place. Works on any mesh: every rank must
    call it, since DTensor shards
    (FSDP, TP, both) are gathered one parameter at a time with ``full_tensor()``; under pipeline
    parallel, pass the pipeline's ``pp_group``: the ranks of rank 0's pipeline send their stages'
    parameters to rank 0, one tensor at a time. Only rank 0 holds the whole model (on the host) and
    writes; ``dtype`` casts on the way (default: the parameters' own). Every tensor ``sources``
    names must arrive. Returns ``out_dir`` on rank 0, None elsewhere."""
    from torch.distributed.tensor import DTensor

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{str(out)!r} is a file; export to a directory (it is created if missing)")
    if importlib.util.find_spec("safetensors") is None:  # every rank checks, before any collective
        raise UsageError("exporting a safetensors checkpoint needs safetensors: pip install 'mmm[hf]'")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    members = dist.get_process_group_ranks(pp_group) if pp_group is not None else [rank]
    collects = 0 in members  # this rank belongs to rank 0's pipeline (or is rank 0)
    tensors: dict[str, torch.Tensor] = {}
    params = [(canonical_name(n), p) for n, p in model.named_parameters()]
    unknown = [n for n, _ in params if n not in sources]
    if unknown:
        raise UsageError(
            f"{type(model).__name__} has parameters the export does not name (sources=): {', '.join(unknown[:4])}"
        )
    if collects and rank != 0:  # a later stage of rank 0's pipeline: say what will come, then send it
        dist.send_object_list([[(sources[n].key, tuple(p.shape), p.dtype) for n, p in params]], dst=0, group=pp_group)
    for name, param in params:
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if not collects:
            continue  # gathered only because the collective needs every rank of the mesh
        hd = sources[name].rotary_head_dim
        full = _rotate(full, hd) if hd else full
        if rank == 0:
            tensors[sources[name].key] = full.to("cpu", dtype or full.dtype).contiguous()
        else:
            dist.send(full.contiguous(), dst=0, group=pp_group)
        del full
    if rank == 0:
        for peer in members:
            if peer == 0:
                continue
            listing: list = [None]
            dist.recv_object_list(listing, src=peer, group=pp_group)
            device = next(iter(model.parameters())).device
            for key, shape, param_dtype in listing[0]:
                buf = torch.empty(shape, dtype=param_dtype, device=device)
                dist.recv(buf, src=peer, group=pp_group)
                tensors[key] = buf.to("cpu", dtype or param_dtype).contiguous()
    try:  # rank 0 writes; every rank learns how it went (none waits at a barrier if it fails)
        on_rank0(
            lambda: _write_checkpoint(
                out, tensors, expected={s.key for s in sources.values()}, config=config, files=files
            )
        )
    except (OSError, RankZeroFailed) as e:
        if not no_space(e):
            raise
        raise RunError(
            f"export to {str(out)!r}: no space left in {str(out.parent)!r}; nothing there was changed (the earlier "
            "contents stay): free space and export again"
        ) from None
    return out if rank == 0 else None


def _write_checkpoint(
    out: Path,
    tensors: dict[str, torch.Tensor],
    *,
    expected: set[str],
    config: Mapping | None,
    files: Mapping[str, bytes] | None = None,
) -> None:
    from safetensors.torch import save_file

    missing = sorted(expected - set(tensors))
    if missing:
        raise UsageError(
            f"cannot export: no rank sent {', '.join(missing[:4])}; under pipeline parallel pass "
            "pp_group= so that the other stages reach rank 0"
        )
    # Everything goes to a new folder beside ``out`` first; only a complete, durable export takes its
    # place, and whatever ``out`` held before (an earlier export, or the very weights this run started
    # from with --init-from) is moved aside whole, never deleted, never read for file names to delete.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{time.time_ns()}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, data in (files or {}).items():  # e.g. tokenizer.json: in the folder before it is complete
            (tmp / name).write_bytes(data)
        mode = 0o666 & ~_umask()  # safetensors writes 0600: the weights as readable as the config beside them
        for f in tmp.iterdir():
            f.chmod(mode)
            fsync_path(f)
        fsync_path(tmp)
        crash_point("export")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # our own incomplete export; nothing of ``out`` touched
        raise
    aside = None
    if out.exists() and any(out.iterdir()):
        aside = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}")
        os.replace(out, aside)
    elif out.exists():
        out.rmdir()
    os.replace(tmp, out)
    fsync_path(out.parent)
    if aside is not None:
        get_logger().info("export: what %s held before is now %s (nothing was deleted)", out, aside)


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would, for every thread, for a moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
