"""The ViT's tensor parallel plan, as data for :func:`mmm.parallel.parallelize`, and what a TP degree
requires of its shapes."""

from __future__ import annotations

from mmm.errors import API, Spelling

# q/k/v and fc1 column-wise, proj and fc2 row-wise: heads and MLP width split, activations between
# blocks replicated
VIT_TP_PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc1": "colwise",
    "blocks.*.mlp.fc2": "rowwise",
}


def vit_tp_problems(*, tp: int, num_heads: int, spell: Spelling = API) -> list[str]:
    """What a TP degree requires of the ViT's shapes (:class:`~mmm.models.vit.ViTConfig` fields)."""
    if tp > 1 and num_heads % tp:
        return [f"{spell('num_heads', num_heads)} is not divisible by tp={tp}; heads are split over TP ranks"]
    return []
