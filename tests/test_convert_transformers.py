"""The conversion presets against the real module layouts of Hugging Face transformers v5.

For each MoE model class, a tiny model's state dict (the v5 layout: stacked
``experts.gate_up_proj`` / ``experts.down_proj``) is turned into the per-expert layout of
the released checkpoints by transformers' own ``revert_weight_conversion`` (what
``save_pretrained`` writes); ``dsdmerge.convert`` with the preset (after the renames
transformers also applies) must give back the v5 state dict, key for key, bit for bit.
Qwen3-VL-MoE's checkpoints store the stacked experts transposed, which transformers
transposes when loading: there ``from_pretrained`` of such a checkpoint is the oracle.
Skipped without transformers (``pip install transformers``).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import story
import torch

import dsdmerge as dm

transformers = pytest.importorskip("transformers", minversion="5.0")
core_model_loading = pytest.importorskip("transformers.core_model_loading")

TINY = {
    "hidden_size": 8,
    "intermediate_size": 12,
    "moe_intermediate_size": 6,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 16,
    "num_experts": 3,
    "num_local_experts": 3,
    "n_routed_experts": 3,
    "num_experts_per_tok": 2,
    "head_dim": 4,
    "max_position_embeddings": 32,
    "shared_expert_intermediate_size": 6,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "kv_lora_rank": 4,
    "q_lora_rank": 4,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 4,
    "n_group": 1,
    "topk_group": 1,
    "decoder_sparse_step": 1,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 1,
    "expert_layer_offset": 0,
    "mamba_d_state": 4,
    "mamba_dt_rank": 2,
    "mamba_expand": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MIXTRAL_STYLE = {r"\.block_sparse_moe\.": ".mlp."}
MODELS = [
    # (model class, rename rules transformers applies too, presets)
    ("Qwen2MoeForCausalLM", None, ["stack_experts"]),
    ("Qwen3MoeForCausalLM", None, ["stack_experts"]),
    ("Qwen3NextForCausalLM", None, ["stack_experts"]),
    ("DeepseekV2ForCausalLM", None, ["stack_experts"]),
    ("DeepseekV3ForCausalLM", None, ["stack_experts"]),
    ("OlmoeForCausalLM", None, ["stack_experts"]),
    ("Glm4MoeForCausalLM", None, ["stack_experts"]),
    ("Dots1ForCausalLM", None, ["stack_experts"]),
    ("HunYuanMoEV1ForCausalLM", None, ["stack_experts"]),
    ("JambaForCausalLM", None, ["stack_experts"]),
    ("MixtralForCausalLM", MIXTRAL_STYLE, ["stack_experts_w123"]),
    ("MiniMaxForCausalLM", MIXTRAL_STYLE, ["stack_experts_w123"]),
    (
        "PhimoeForCausalLM",
        {**MIXTRAL_STYLE, r"\.gate\.weight$": ".router.weight"},
        ["stack_experts_w123"],
    ),
]


def tiny(name: str):
    model_cls = getattr(transformers, name)
    config_cls = model_cls.config_class
    params = inspect.signature(config_cls.__init__).parameters
    config = config_cls(**{k: v for k, v in TINY.items() if k in params})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_cls(config)


@pytest.mark.parametrize(("name", "rename", "presets"), MODELS, ids=[m[0] for m in MODELS])
def test_presets_give_the_transformers_v5_layout_of_released_checkpoints(name, rename, presets):
    model = tiny(name)
    v5 = model.state_dict()
    released = core_model_loading.revert_weight_conversion(model, dict(v5))
    assert any(".experts.0." in k for k in released), (
        "the released layout has one module per expert"
    )
    if rename is not None:
        released = dm.rename(released, rename)
    converted = dm.convert(released, presets)
    assert story.tree_differences(dict(v5), converted) == []


def test_transpose_experts_matches_transformers_loading_qwen3_vl_moe(tmp_path):
    from safetensors.torch import load_file, save_file

    text = {k: v for k, v in TINY.items() if k not in ("num_local_experts",)}
    text.update(
        num_hidden_layers=1, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 0]}
    )
    vision = {
        "depth": 1,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_heads": 2,
        "out_hidden_size": 8,
    }
    config = transformers.Qwen3VLMoeConfig(
        text_config=text, vision_config={**vision, "deepstack_visual_indexes": []}
    )
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    (shard,) = tmp_path.glob("*.safetensors")
    saved = load_file(shard)
    # as Qwen released them: stacked experts x hidden x 2*intermediate
    released = {
        k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in saved.items()
    }
    assert sum(".experts." in k for k in released) == 2
    save_file(released, shard, metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path)
    want = {k: v for k, v in loaded.state_dict().items() if k in released}
    assert sum(".experts." in k for k in want) == 2
    got = dm.convert(released, ["transpose_experts"])
    assert story.tree_differences(want, {k: got[k] for k in want}) == []
