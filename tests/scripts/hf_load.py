"""Load a Hugging Face Llama checkpoint into mmm's sharded Llama; compare logits with transformers'.

launch -n 4 python tests/scripts/hf_load.py CKPT_DIR --tp 2     # prints "max abs diff <x>" on every rank
launch -n 4 python tests/scripts/hf_load.py CKPT_DIR --tp 2 --hf-model   # into transformers' own model
"""

import argparse
import sys

import torch

from mmm import dist


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--hf-model", action="store_true", help="load into transformers' LlamaForCausalLM (own names)")
    args = ap.parse_args(argv)
    info = dist.setup()
    from transformers import AutoConfig, LlamaForCausalLM

    from mmm.models.hf import HF_LLAMA_TP_PLAN
    from mmm.models.llama import Llama, llama_config_from_hf, llama_tp_plan, load_hf_llama
    from mmm.parallel import ParallelSpec, init_mesh, meta_init, parallelize
    from mmm.parallel.hf_checkpoint import load_safetensors

    mesh = init_mesh(tp=args.tp)
    cfg = llama_config_from_hf(args.ckpt, seq_len=16)
    if args.hf_model:
        with meta_init():
            model = LlamaForCausalLM(AutoConfig.from_pretrained(args.ckpt))
        model = parallelize(model, mesh, ParallelSpec(tp_plan=HF_LLAMA_TP_PLAN), device=info.device, seed=0)
        unused = load_safetensors(model, args.ckpt)
        sys.stdout.write(f"rank {info.rank}: unused {unused}" + "\n")
    else:
        with meta_init():
            model = Llama(cfg)
        model = parallelize(
            model, mesh, ParallelSpec(tp_plan=llama_tp_plan(), loss_parallel=True), device=info.device, seed=0
        )
        load_hf_llama(model, args.ckpt)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        ours = getattr(ours, "logits", ours)
        ours = ours.full_tensor() if hasattr(ours, "full_tensor") else ours
        theirs = LlamaForCausalLM.from_pretrained(args.ckpt, torch_dtype=torch.float32).eval()(tokens).logits
    diff = (ours - theirs).abs().max().item()
    sys.stdout.write(f"rank {info.rank}: max abs diff {diff:.3g} (logits std {theirs.std().item():.3g})" + "\n")
    return 0 if diff <= 1e-5 else 1


if __name__ == "__main__":
    dist.run_main(main)
