#!/usr/bin/env python3
"""Generate tiny, deterministic HuggingFace reference checkpoints for seven more model families.

Run with the reference venv (see tools/README.md):

    tools/.venv/bin/python tools/make_family_fixtures.py     # writes fixtures/tiny-{olmo,olmo2,gemma,phi3,
                                                             #   starcoder2,falcon,bloom}/

Everything runs on CPU in float32 with fixed seeds, ``torch.set_num_threads(1)`` and
``torch.use_deterministic_algorithms(True)``. Models are built with transformers' own classes (eager attention)
and written with ``save_pretrained(..., safe_serialization=True)``, so ``config.json``,
``generation_config.json`` and the single ``model.safetensors`` (f32 on disk) are exactly what transformers
5.23 writes. Next to them every fixture directory holds:

* ``reference.safetensors``
    - ``input_ids``   int64 [2, 24]        uniform random in [0, vocab) (seeded)
    - ``logits``      f32 [2, 24, vocab]   ``model(input_ids).logits``, eval mode
    - ``prompt_ids``  int64 [2, 8]         ``input_ids[:, :8]``
    - ``greedy``      int64 [2, 8+16]      ``model.generate(prompt_ids, ...)``: prompt + exactly 16 new tokens
                                           of plain argmax decoding. The model's ``generation_config`` is
                                           swapped for a bare one during the call (``eos_token_id=None``, so no
                                           early stop and no EOS forcing; no repetition penalty, no
                                           suppressed tokens, no min length), the attention mask is all ones,
                                           and the script asserts that every step's processed scores equal the
                                           raw logits (no logits processor ran) and that the result equals a
                                           manual loop of full forward passes (no cache) + argmax.
                                           Seeds are chosen so no generated token is EOS (2) and every row
                                           changes token at least once (asserted): tiny tied models
                                           (Gemma, Bloom) otherwise tend to repeat one token.
* ``grads.safetensors``  (like make_grad_fixtures.py, but full gradients for *every* parameter)
    - ``loss``                    f32 [1]  ``model(input_ids, labels=input_ids).loss`` in train mode (all
                                           dropout probabilities are 0 in the configs; the script asserts
                                           train-mode logits equal eval-mode logits), i.e. the mean next-token
                                           cross entropy over the 2*23 shifted positions
    - ``grad_norm.<param name>``  f32 [1]  L2 norm of the gradient (HF names, ``named_parameters()``: a tied
                                           ``lm_head.weight`` is not listed, its gradient is in the embedding's)
    - ``grad.<param name>``       f32      the full gradient

Weights are re-initialised deterministically by the kind of module that owns them (independent of
transformers' init code): every Linear/Embedding weight ``0.15*randn``, every norm weight ``1 + 0.2*randn``
(Gemma's RMSNorm computes ``x_hat * (1 + w)``, so there ``w = 0.2*randn``, giving the same effective gain), every
bias (linear or LayerNorm) ``0.1*randn``. A loader that forgets a norm weight or bias is therefore caught.
After saving, each fixture is re-loaded from disk (``AutoModelForCausalLM.from_pretrained(dir,
dtype=float32, attn_implementation="eager")``) and its logits are checked to be bit-identical to the stored
reference; the gradients are computed on the re-loaded model. Every config field passed is checked to be a
field of the transformers 5.23 config class and to read back unchanged.

Which fixture covers which case
-------------------------------
tiny-olmo        OlmoForCausalLM; non-parametric LayerNorm (no norm weights at all in the file; eps fixed at
                 1e-5 in OlmoLayerNorm); GQA 4 heads / 2 kv heads (head_dim 12); silu gated MLP (80);
                 clip_qkv None; no attention bias; default rope theta 10000; untied ``lm_head.weight``.
tiny-olmo2       Olmo2ForCausalLM; RMSNorm eps 1e-6 applied *after* the sublayers (``post_attention_layernorm``,
                 ``post_feedforward_layernorm``, no input norm); ``q_norm`` / ``k_norm`` RMSNorms over the full
                 projected width (q_norm [48], k_norm [24] = 2 kv heads * 12), applied before rope; GQA 4/2;
                 untied.
tiny-gemma       GemmaForCausalLM (Gemma 1); MQA (4 heads, 1 kv head); explicit head_dim 16 != 48/4, so q_proj is
                 [64, 48], k/v_proj [16, 48], o_proj [48, 64]; ``hidden_act="gelu_pytorch_tanh"`` gated MLP (the
                 5.23 config has no ``hidden_activation`` field); RMSNorm ``x_hat * (1 + w)`` with eps 1e-6;
                 embeddings scaled by sqrt(48) (a non-persistent buffer, cast to the weight dtype); tied embeddings (no ``lm_head.weight``).
tiny-phi3        Phi3ForCausalLM; fused ``qkv_proj`` [48+2*12+2*12 = 96, 48] (q | k | v rows) and fused
                 ``gate_up_proj`` [160, 48] (gate rows first, then up); GQA 4/2; rope_parameters default, theta
                 10000, ``partial_rotary_factor`` 1.0 (it lives in ``rope_parameters`` in 5.23); no rope
                 scaling; original_max_position_embeddings 128; sliding_window None; untied.
tiny-starcoder2  Starcoder2ForCausalLM; ``use_bias`` True: biases on q/k/v/o and on the non-gated MLP
                 ``c_fc`` [80, 48] / ``c_proj`` [48, 80]; LayerNorm (weight + bias) with ``norm_epsilon`` 1e-5;
                 gelu_pytorch_tanh; GQA 4/2; sliding_window None; residual/embedding/attention dropout 0; tied.
tiny-falcon      FalconForCausalLM (Falcon-7B layout); new_decoder_architecture False, multi_query True
                 (one kv head: ``query_key_value`` is [48+2*12 = 72, 48], rows q(4 heads) | k | v), parallel_attn
                 True (one ``input_layernorm`` feeds attention and MLP, both added to the residual); bias False
                 (Linear layers have no bias but the LayerNorms do); rotary (alibi False), theta 10000; MLP
                 ``dense_h_to_4h`` [192, 48] with exact ``gelu`` (activation default); layer_norm_epsilon 1e-5; tied.
                 The saved config.json carries ``num_kv_heads: 4`` (defaulted to num_attention_heads by the
                 config class) although the model uses ONE kv head: multi_query wins when
                 new_decoder_architecture is False.
tiny-bloom       BloomForCausalLM; ALiBi with n_head 6 (head_dim 8): 6 is not a power of two, so the slope
                 formula's extra-slopes branch is exercised (slopes 1/4, 1/16, 1/64, 1/256, 1/2, 1/8 -- asserted);
                 ``word_embeddings_layernorm`` after the embedding; fused ``query_key_value`` [144, 48] laid out
                 per head as (q, k, v) interleaved, i.e. view [6, 3, 8, 48]; biases everywhere; MLP 4*hidden = 192
                 with Bloom's tanh gelu; layer_norm_epsilon 1e-5; apply_residual_connection_post_layernorm False;
                 no position embeddings (no max_position_embeddings field); tied.

All models: hidden 48, 2 layers, vocab 112, max_position_embeddings 128 (where the config has it),
intermediate 80 (where the config has it; Falcon and Bloom use 4*hidden = 192), bos 1, eos 2, no pad token
(``pad_token_id`` None: transformers builds ``nn.Embedding(..., padding_idx=pad_token_id)``, which zeroes that
row's gradient, a training behaviour Megatron does not have; generation pads with 0, never used).
input_ids are uniform random in [0, vocab) (seeded), batch 2, seq 24.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import transformers
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    GenerationConfig,
    Olmo2Config,
    Olmo2ForCausalLM,
    OlmoConfig,
    OlmoForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
BATCH, SEQ = 2, 24
PROMPT, NEW_TOKENS = 8, 16
MAX_DIR_BYTES = 768 * 1024
FAMILIES = ("olmo", "olmo2", "gemma", "phi3", "starcoder2", "falcon", "bloom")

TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=None)
# What generate() pads with (no sequence finishes early, so it is never used).
GENERATION_PAD = 0
# Fields shared by the Llama-like configs (all but Falcon and Bloom).
COMMON = dict(
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=112,
    max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    **TOKENS,
)


def setup_determinism() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)


def make_config(config_cls, **fields):
    """Build a config, checking every field name exists in the 5.23 class and reads back unchanged."""
    known = set(inspect.signature(config_cls.__init__).parameters) | set(getattr(config_cls, "attribute_map", {}))
    unknown = sorted(set(fields) - known)
    assert not unknown, f"{config_cls.__name__}: unknown config fields {unknown}"
    config = config_cls(**fields)
    for k, v in fields.items():
        got = getattr(config, k)
        if isinstance(v, dict):
            assert {kk: got.get(kk) for kk in v} == v, f"{config_cls.__name__}.{k}: {got} != {v}"
        else:
            assert got == v, f"{config_cls.__name__}.{k}: {got!r} != {v!r}"
    config._attn_implementation = "eager"
    return config


def is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm) or "Norm" in type(module).__name__


def perturb_(model: torch.nn.Module, seed: int, norm_offset: float = 1.0) -> None:
    """Re-initialise every parameter deterministically by the kind of module that owns it.

    Linear/Embedding weights 0.15*randn, norm weights norm_offset + 0.2*randn, biases 0.1*randn.
    """
    kind = {}
    for mod in model.modules():
        for pname, p in mod.named_parameters(recurse=False):
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and pname == "weight":
                k = "matrix"
            elif is_norm(mod) and pname == "weight":
                k = "norm"
            elif pname == "bias" and (isinstance(mod, torch.nn.Linear) or is_norm(mod)):
                k = "bias"
            else:
                raise AssertionError(f"unexpected parameter {pname} of {type(mod).__name__}")
            assert kind.get(id(p), k) == k
            kind[id(p)] = k
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            k = kind[id(p)]
            if k == "norm":
                p.copy_(norm_offset + 0.2 * noise)
            elif k == "bias":
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)


def build(cls, config, seed: int, norm_offset: float = 1.0):
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    perturb_(model, seed, norm_offset)
    model.eval()
    return model


def make_inputs(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g, dtype=torch.int64)


@torch.no_grad()
def run_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    out = model(input_ids=input_ids)
    return out.logits.detach().to(torch.float32).contiguous()


@torch.no_grad()
def greedy(model, prompt: torch.Tensor) -> torch.Tensor:
    """``model.generate`` with plain argmax for exactly NEW_TOKENS tokens, checked against a manual loop."""
    model.eval()
    saved = model.generation_config
    # A bare generation config: nothing from the model's generation_config.json (eos 2 etc.) leaks in.
    model.generation_config = GenerationConfig(pad_token_id=GENERATION_PAD)
    gen_cfg = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        eos_token_id=None,
        pad_token_id=GENERATION_PAD,
        repetition_penalty=1.0,
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
    )
    try:
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gen_cfg)
    finally:
        model.generation_config = saved
    seqs = out.sequences
    assert seqs.shape == (BATCH, PROMPT + NEW_TOKENS), seqs.shape
    assert torch.equal(seqs[:, :PROMPT], prompt)
    assert len(out.scores) == NEW_TOKENS and len(out.logits) == NEW_TOKENS
    for s, l in zip(out.scores, out.logits):
        assert torch.equal(s, l), "a logits processor changed the scores"
    # Manual greedy: full forward pass (no cache) over the whole prefix, argmax of the last position.
    ids = prompt.clone()
    for step in range(NEW_TOKENS):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]
        nxt = logits.argmax(dim=-1, keepdim=True)
        # The top-2 gap must be clear so cached/uncached float differences cannot flip the argmax.
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-4, f"near-tie at step {step}"
        ids = torch.cat([ids, nxt], dim=1)
    assert torch.equal(ids, seqs), f"generate != manual greedy loop:\n{seqs}\n{ids}"
    new = seqs[:, PROMPT:]
    # Seeds are chosen so that the fixture does not depend on EOS handling and every row changes token at
    # least once (tiny tied models tend to repeat the current token forever).
    assert not (new == TOKENS["eos_token_id"]).any(), "eos generated"
    assert all(len(set(row)) >= 2 for row in new.tolist()), f"constant continuation {new.tolist()}"
    return seqs.contiguous()


def grads(model, input_ids: torch.Tensor, eval_logits: torch.Tensor) -> tuple[dict, float]:
    model.train()  # dropout probabilities are 0 in these configs
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            assert m.p == 0.0, f"dropout {m.p}"
    model.zero_grad(set_to_none=True)
    out = model(input_ids, labels=input_ids)
    assert torch.equal(out.logits.detach(), eval_logits), "train-mode logits differ from eval-mode logits"
    out.loss.backward()
    tensors = {"loss": out.loss.detach().reshape(1).contiguous()}
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {pname}"
        tensors[f"grad_norm.{pname}"] = p.grad.norm().reshape(1).contiguous()
        tensors[f"grad.{pname}"] = p.grad.detach().contiguous()
    model.eval()
    return tensors, out.loss.item()


def finish(name: str, model, seed: int, tied: bool) -> Path:
    out = FIXTURES / name
    if out.exists():
        for f in out.iterdir():
            f.unlink()
    else:
        out.mkdir(parents=True)
    vocab = model.config.vocab_size
    input_ids = make_inputs(vocab, seed)
    logits = run_logits(model, input_ids)
    prompt = input_ids[:, :PROMPT].contiguous()
    gen = greedy(model, prompt)

    assert tied == (model.get_output_embeddings().weight is model.get_input_embeddings().weight), f"{name}: tied?"
    model.save_pretrained(out, safe_serialization=True)
    files = sorted(f.name for f in out.iterdir())
    assert "model.safetensors" in files and not any(f.startswith("model-") for f in files), files
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert all(f.get_slice(k).get_dtype() == "F32" for k in keys), f"{name}: not f32 on disk"
    assert ("lm_head.weight" in keys) != tied, f"{name}: lm_head.weight present={'lm_head.weight' in keys}"
    save_file(
        {"input_ids": input_ids, "logits": logits, "prompt_ids": prompt, "greedy": gen},
        str(out / "reference.safetensors"),
    )

    # Re-load from disk in f32 and check bit-identical logits; gradients come from the re-loaded model.
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    assert type(reloaded) is type(model)
    again = run_logits(reloaded, input_ids)
    if not torch.equal(again, logits):
        diff = (again - logits).abs().max().item()
        raise AssertionError(f"{name}: reloaded logits differ from reference (max abs diff {diff})")
    g, loss = grads(reloaded, input_ids, logits)
    save_file(g, str(out / "grads.safetensors"))

    std = logits.std().item()
    assert std > 0.3, f"{name}: logits std {std} too small"
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size < MAX_DIR_BYTES, f"{name}: fixture dir is {size} bytes (> {MAX_DIR_BYTES})"
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n_params} params, logits std {std:.3f}, loss {loss:.6f}, dir {size} bytes")
    print(f"  greedy continuation: {gen[:, PROMPT:].tolist()}")
    for pname, p in model.named_parameters():
        if ".layers.0." in pname or ".h.0." in pname:
            print(f"  {pname} {list(p.shape)}")
    return out


def tiny_olmo() -> None:
    cfg = make_config(OlmoConfig, **COMMON, hidden_act="silu", clip_qkv=None, attention_bias=False,
                      attention_dropout=0.0, tie_word_embeddings=False)
    model = build(OlmoForCausalLM, cfg, seed=11)
    assert not any("norm" in n for n, _ in model.named_parameters()), "OLMo norms must be non-parametric"
    finish("tiny-olmo", model, seed=111, tied=False)


def tiny_olmo2() -> None:
    cfg = make_config(Olmo2Config, **COMMON, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False,
                      attention_dropout=0.0, tie_word_embeddings=False)
    model = build(Olmo2ForCausalLM, cfg, seed=12)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (48,) and attn.k_norm.weight.shape == (24,)
    finish("tiny-olmo2", model, seed=112, tied=False)


def tiny_gemma() -> None:
    cfg = make_config(GemmaConfig, **{**COMMON, "num_key_value_heads": 1}, head_dim=16,
                      hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, attention_bias=False,
                      attention_dropout=0.0, tie_word_embeddings=True)
    # Gemma's RMSNorm multiplies by (1 + w): check, then perturb w around 0.
    norm = GemmaForCausalLM(cfg).model.norm
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        norm.weight.fill_(1.0)
        want = 2.0 * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.allclose(norm(x), want, rtol=1e-5, atol=1e-6), "GemmaRMSNorm is not x_hat * (1 + w)"
    model = build(GemmaForCausalLM, cfg, seed=16, norm_offset=0.0)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (64, 48) and attn.k_proj.weight.shape == (16, 48)
    finish("tiny-gemma", model, seed=116, tied=True)


def tiny_phi3() -> None:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    cfg = make_config(Phi3Config, **{**COMMON, "rope_parameters": rope}, hidden_act="silu", rms_norm_eps=1e-5,
                      original_max_position_embeddings=128, sliding_window=None, resid_pdrop=0.0, embd_pdrop=0.0,
                      attention_dropout=0.0, tie_word_embeddings=False)
    model = build(Phi3ForCausalLM, cfg, seed=14)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == (96, 48) and layer.mlp.gate_up_proj.weight.shape == (160, 48)
    finish("tiny-phi3", model, seed=114, tied=False)


def tiny_starcoder2() -> None:
    cfg = make_config(Starcoder2Config, **COMMON, hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5,
                      use_bias=True, sliding_window=None, residual_dropout=0.0, embedding_dropout=0.0,
                      attention_dropout=0.0, tie_word_embeddings=True)
    model = build(Starcoder2ForCausalLM, cfg, seed=16)
    finish("tiny-starcoder2", model, seed=116, tied=True)


def tiny_falcon() -> None:
    cfg = make_config(FalconConfig, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=112,
                      max_position_embeddings=128, rope_parameters=COMMON["rope_parameters"],
                      new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
                      alibi=False, layer_norm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
                      tie_word_embeddings=True, **TOKENS)
    assert cfg.ffn_hidden_size == 192 and cfg.activation == "gelu"
    model = build(FalconForCausalLM, cfg, seed=16)
    attn = model.transformer.h[0].self_attention
    assert attn.num_kv_heads == 1 and attn.query_key_value.weight.shape == (72, 48)
    finish("tiny-falcon", model, seed=116, tied=True)


def tiny_bloom() -> None:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    cfg = make_config(BloomConfig, hidden_size=48, n_layer=2, n_head=6, vocab_size=112, layer_norm_epsilon=1e-5,
                      apply_residual_connection_post_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0,
                      pretraining_tp=1, slow_but_exact=False, tie_word_embeddings=True, **TOKENS)
    slopes = _get_alibi_slopes(6, torch.device("cpu")).tolist()
    assert slopes == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8], slopes
    print(f"tiny-bloom: ALiBi slopes for 6 heads {slopes}")
    model = build(BloomForCausalLM, cfg, seed=53)
    assert model.transformer.h[0].self_attention.query_key_value.weight.shape == (144, 48)
    finish("tiny-bloom", model, seed=153, tied=True)


def main() -> int:
    setup_determinism()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    FIXTURES.mkdir(exist_ok=True)
    tiny_olmo()
    tiny_olmo2()
    tiny_gemma()
    tiny_phi3()
    tiny_starcoder2()
    tiny_falcon()
    tiny_bloom()
    print("\nfiles:")
    for fam in FAMILIES:
        for f in sorted((FIXTURES / f"tiny-{fam}").iterdir()):
            print(f"  {f.relative_to(ROOT)}  {f.stat().st_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
