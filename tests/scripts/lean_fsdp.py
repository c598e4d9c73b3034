"""fully_shard's sharded parameters with mmm's lean setup and with torch's own, compared field by field.

    python tests/scripts/lean_fsdp.py WORLD TP DP_REPLICATE RANK...

For each rank: joins a fake process group of WORLD ranks, builds mmm's Llama with shapes that do
not split evenly (one shard rank left empty), applies TP (if TP > 1) and FSDP or HSDP through
``mmm.parallel.parallelize`` twice, once with ``MMM_LEAN_FSDP_SETUP=0`` (torch's ``fully_shard``
as is) and once with the lean setup, and prints one JSON line
per rank: the parameters compared and the differences found (none expected).
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from mmm.models.llama import Llama, LlamaConfig
from mmm.models.llama.tp import llama_tp_plan
from mmm.parallel import init_mesh, meta_init, parallelize
from mmm.parallel.fsdp_setup import lean_fully_shard
from mmm.plan.fake import forget_meshes


class Made(TorchDispatchMode):
    """Counts the tensors torch's ops make (views included) and the device meshes built while on."""

    def __init__(self):
        super().__init__()
        self.tensors = self.meshes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors += sum(isinstance(t, torch.Tensor) for t in (out if isinstance(out, (list, tuple)) else [out]))
        return out

    def __enter__(self):
        init = self._init = DeviceMesh.__init__

        def counted(mesh, *args, **kwargs):
            self.meshes += 1
            init(mesh, *args, **kwargs)

        DeviceMesh.__init__ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        DeviceMesh.__init__ = self._init
        return super().__exit__(*exc)


def fsdp_params(model):
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        group = state()._fsdp_param_group
        if group is not None:
            yield from group.fsdp_params


def described(p) -> dict:
    """What torch's FSDPParam made of one parameter: sizes, strides, the local shard, the meshes."""
    local = p.sharded_param._local_tensor
    spec = p.sharded_param._spec
    row = {
        "sharded_size": tuple(p.sharded_size),
        "padded": tuple(p.padded_sharded_param_size),
        "stride": tuple(p.contiguous_sharded_stride),
        "local": (tuple(local.shape), tuple(local.stride()), local.storage_offset()),
        "data": p._sharded_param_data.clone(),
        "placements": tuple(spec.placements),
        "mesh": spec.mesh,
        "groups": tuple(spec.mesh._dim_group_names),  # DeviceMesh equality leaves out its process groups
        "shard_mesh": p.shard_mesh,
        "post_forward": tuple(getattr(p, "sharded_post_forward_size", ()) or ()),
    }
    if hasattr(p, "_spmd_mesh"):
        row["spmd_mesh"] = p._spmd_mesh
    return row


def differences(a: dict, b: dict) -> list[str]:
    out = []
    for key in a.keys() | b.keys():
        x, y = a.get(key), b.get(key)
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        if not same:
            out.append(f"{key}: {x!r} != {y!r}")
    return out


def main() -> None:
    world, tp, replicate, *ranks = (int(a) for a in sys.argv[1:])
    # vocabulary 38: 19 rows per TP rank, which 8 shard ranks split 3,3,3,3,3,3,1,0 (an empty shard)
    cfg = LlamaConfig(dim=24, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=38, seq_len=8, ffn_hidden_dim=40)
    for rank in ranks:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MMM_DEVICE="cpu")
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        dp_shard = world // tp // replicate
        mesh = init_mesh(dp_replicate=replicate, dp_shard=dp_shard, tp=tp, device_type="cpu", log_coordinates=False)
        with meta_init():  # materialised from the seed: each rank's values without collectives
            base = Llama(cfg)
        options = {"dp": "hsdp" if replicate > 1 else "fsdp"}
        if tp > 1:
            options |= {"tp_plan": llama_tp_plan(), "loss_parallel": True}
        rows, made = {}, {}
        for lean in ("0", "1"):
            os.environ["MMM_LEAN_FSDP_SETUP"] = lean
            with Made() as made[lean]:
                model = parallelize(copy.deepcopy(base), mesh, device=torch.device("cpu"), seed=0, **options)
            rows[lean] = [described(p) for p in fsdp_params(model)]
        with lean_fully_shard() as applied:
            pass
        diffs = [d for a, b in zip(rows["0"], rows["1"], strict=True) for d in differences(a, b)]
        empty = sum(r["local"][0][0] == 0 for r in rows[lean])
        dist.destroy_process_group()
        forget_meshes()  # DTensor's caches of the last rank's meshes (as the simulator does between ranks)
        row = {"rank": rank, "params": len(rows[lean]), "empty": empty, "applied": applied, "diffs": diffs}
        row["tensors_made"] = [made["0"].tensors, made["1"].tensors]  # torch's own, lean
        row["meshes_made"] = [made["0"].meshes, made["1"].meshes]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
