"""Tiny random-weight models saved to disk, loadable by both vLLM and HF transformers, and the
steering vectors and specs the tests use on them.

Head dim 64 (the CPU attention backend's smallest supported size), fp32, 4 layers.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

VOCAB = 512
HIDDEN = 128
LAYERS = 4


def vec(seed: int, norm: float = 4.0) -> list[float]:
    """A random direction of the tiny models' residual stream with norm ``norm`` (a steering
    vector; ``norm=1.0`` for probe weights)."""
    v = np.random.RandomState(seed).randn(HIDDEN)
    return (v / np.linalg.norm(v) * norm).tolist()


STATIC_CASES = {
    "pre_attn-all": [{"vector": vec(1), "layers": [0, 2], "hook": "pre_attn"}],
    "pre_attn-prefill": [{"vector": vec(2), "layers": [1, 3], "hook": "pre_attn",
                          "phase": "prefill"}],
    "post_attn-all": [{"vector": vec(3), "layers": [1, 2], "hook": "post_attn", "scale": 1.5}],
    "post_attn-decode": [{"vector": vec(4), "layers": [0, 3], "hook": "post_attn",
                          "phase": "decode"}],
    "post_block-all": [{"vector": vec(5), "layers": [0, 1, 3], "hook": "post_block"}],
    "post_block-decode": [{"vector": vec(6), "layers": [2], "phase": "decode", "scale": -2.0}],
    "mixed-phases": [
        {"vector": vec(7), "layers": [1], "hook": "pre_attn", "phase": "prefill"},
        {"vector": vec(8), "layers": [1, 2], "hook": "post_attn", "phase": "decode"},
        {"vector": vec(9), "layers": [3], "hook": "post_block"},
    ],
}
"""Static steering entries per case: every hook, every phase, scales, several layers."""


ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 64}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {
        "embedding_multiplier": 3.0, "residual_multiplier": 0.6,
        "attention_multiplier": 0.2, "logits_scaling": 2.0}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 256,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True, "pad_token_id": 0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 256,
        "tie_word_embeddings": True, "pad_token_id": 0}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 128, "pad_token_id": 0}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}),
    "opt": ("OPTConfig", "OPTForCausalLM", {
        "ffn_dim": 256, "word_embed_proj_dim": 128, "pad_token_id": 0, "enable_bias": True,
        "do_layer_norm_before": True}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "num_key_value_heads": 2}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "topk_method": "noaux_tc", "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "num_key_value_heads": 2}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {
        "head_dim": 64, "partial_rotary_factor": 0.5, "pad_token_id": 0}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {
        "head_dim": 64, "sliding_window": 256, "sliding_window_pattern": 4, "pad_token_id": 0}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "norm_topk_prob": False}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {
        "head_dim": 64, "num_local_experts": 4, "num_experts_per_tok": 1,
        "intermediate_size": 64, "intermediate_size_mlp": 256, "pad_token_id": 0,
        "layer_types": ["full_attention"] * LAYERS, "interleave_moe_layer_step": 1}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {"head_dim": 64, "pad_token_id": 0}),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", {
        "head_dim": 64, "sliding_window": None, "pad_token_id": 0}),
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", {
        "head_dim": 64, "num_dense_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "num_shared_experts": 1, "sliding_window": 256,
        "global_attn_every_n_layers": 2, "pad_token_id": 0, "score_func": "sigmoid",
        "route_norm": True, "n_group": 1, "topk_group": 1}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {
        "layer_types": ["mamba", "attention", "mamba", "attention"], "num_local_experts": 4,
        "num_experts_per_tok": 2, "intermediate_size": 64, "shared_intermediate_size": 64,
        "mamba_n_heads": 4, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 16,
        "embedding_multiplier": 3.0, "residual_multiplier": 0.6, "attention_multiplier": 0.2,
        "logits_scaling": 2.0, "pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {
        "head_dim": 64, "tie_word_embeddings": True, "pad_token_id": 0}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
        "norm_topk_prob": False}),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", {
        "head_dim": 64, "norm_eps": 1e-5, "partial_rotary_factor": 0.5, "pad_token_id": 0}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 64, "pad_token_id": 0}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", {
        "head_dim": 64, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 64,
        "moe_num_shared_experts": 0, "moe_layer_start_index": 1, "moe_layer_interval": 1,
        "pad_token_id": 0}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {
        "head_dim": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "partial_rotary_factor": 0.5, "use_qk_norm": False}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
        "embedding_multiplier": 3.0, "residual_multiplier": 0.6, "attention_multiplier": 0.2,
        "logits_scaling": 2.0, "pad_token_id": 0}),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
        "shared_intermediate_size": 64, "embedding_multiplier": 3.0,
        "residual_multiplier": 0.6, "attention_multiplier": 0.2, "logits_scaling": 2.0,
        "pad_token_id": 0}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {
        "partial_rotary_factor": 0.5, "layer_norm_eps": 1e-5}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {
        "pad_token_id": 0, "logit_scale": 0.5, "layer_norm_eps": 1e-5, "rms_norm_eps": None,
        "tie_word_embeddings": True}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"pad_token_id": 0, "sliding_window": 256}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {
        "rotary_pct": 0.25, "use_parallel_residual": True, "layer_norm_eps": 1e-5,
        "num_key_value_heads": 2}),
    "phi": ("PhiConfig", "PhiForCausalLM", {
        "partial_rotary_factor": 0.5, "layer_norm_eps": 1e-5, "pad_token_id": 0}),
}
"""Each test architecture: HF config class, HF model class, what differs from the common
shape (Cohere, parallel attention + MLP, is the one without ``post_attn``). Multipliers and
soft-caps are set away from 1 / off so the reference tests exercise what makes each
architecture's layer differ from Llama's."""


def make_tiny_model(arch: str, path: Path, seed: int = 0, vocab: int = VOCAB) -> Path:
    """Save a tiny random ``arch`` model (a key of :data:`ARCHITECTURES`) under ``path``."""
    import transformers

    config_name, model_name, extra = ARCHITECTURES[arch]
    common = dict(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=256, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    )
    config = getattr(transformers, config_name)(**{**common, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        # Random init keeps the residual stream small; make norms non-trivial so the per-site
        # math (norm after the steered add) is really exercised.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.config.torch_dtype = "float32"
    model.save_pretrained(path)
    return path


MODELS_ENV = "DYNSTEER_TEST_MODELS"
"""Where test models are kept between runs (default ``~/.cache/dynsteer/test-models``)."""


def stable_model_dir(name: str, build: Callable[[Path], object], *key: object) -> Path:
    """A model folder at a path that is the same in every run with the same ``key`` and the
    same generating code, built once (atomically: parallel runs may race).

    vLLM's compile cache is keyed by the model's path among the rest of the configuration, so
    a test model in a fresh temporary folder is compiled from scratch at every run; at a stable
    path a later run's engines load the compiled graph instead.
    """
    import transformers

    digest = hashlib.sha256(repr((inspect.getsource(make_tiny_model), key,
                                  transformers.__version__)).encode()).hexdigest()[:16]
    root = Path(os.environ.get(MODELS_ENV) or Path.home() / ".cache/dynsteer/test-models")
    folder = root / f"{name}-{digest}"
    if (folder / "config.json").exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(staging)
        os.replace(staging, folder)
    except OSError:
        if not (folder / "config.json").exists():  # lost a race: the winner's copy is used
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder
