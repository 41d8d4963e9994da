"""The Hugging Face reference: transformers' own Gemma 2 / Gemma 3, with the NUTP run's initial
weights put in through Megatron-Bridge's own HF <-> megatron weight mapping.

For the features stock megatron-core cannot build (zero-centred gamma, softcapping,
``query_pre_attn_scalar``, post norms, Gemma 3's per-layer RoPE bases), this is the independent
reference: nothing of this project's model, nor of ``gemma_reference.py``'s named modules, runs
in its forward or backward. The flow, for a case whose ``hf_path`` holds a tiny HF model folder:

1. the NUTP model's ``ModelConfig`` comes from Bridge's provider of that HF config
   (``AutoBridge.to_megatron_provider`` then ``bridge_run.model_config_of``): what a NeMo user's
   run would build (``case_model``);
2. a *carrier*: stock megatron-core's ``GPTModel`` (``reference._build``) holding the NUTP run's
   initial weights by name; Bridge's ``export_hf_weights`` turns them into HF tensors, loaded
   into transformers' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` (eager attention, fp32);
3. transformers' model trains the case (torch SGD with megatron's momentum 0.9, or AdamW as
   megatron's Adam; clipping as megatron's: ``clip_grad_norm_`` has the same formula) on the
   same global batches, each micro-batch's mean token loss averaged as megatron does;
4. its step-0 gradients and its final parameters go back through Bridge's ``load_hf_weights``
   into the carrier, and are recorded by megatron name: the reference file
   ``reference.run_reference`` writes, compared the same way (``parity._compare``).

Every HF tensor must be written by the export and every carrier parameter by the import (a
mapping Bridge silently skips would otherwise compare a tensor with itself).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nemo_nutp.model.init import normalize_name

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=24, sliding_window=4, tie_word_embeddings=True,
            pad_token_id=None)
"""A tiny Gemma: GQA (2 groups, so a TP2 replica holds one each), 24 positions (the window of 4
bites), vocab 101 (uneven over TP2). No padding row: transformers' ``nn.Embedding`` would give
row ``pad_token_id`` no gradient from its inputs, which megatron's embedding (Bridge's Gemma)
does not do (the synthetic tokens include every id)."""


def save_tiny(family: str, path: Path, **overrides: Any) -> Path:
    """A tiny transformers Gemma 2 or Gemma 3 (text) model folder at ``path``: its config.json
    (and random weights: the reference replaces them). ``overrides``: HF config fields."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    kw: dict[str, Any] = {**TINY, "dtype": "float32"}
    if family == "gemma2":
        # caps small enough to bend the tiny model's scores (~0.1: no QK norm) and logits
        # (~0.2) measurably
        kw.update(query_pre_attn_scalar=8, attn_logit_softcapping=0.1,
                  final_logit_softcapping=0.2)
        cls: Any = Gemma2ForCausalLM
        config: Any = Gemma2Config(**{**kw, **overrides})
    elif family == "gemma3":
        # 6 layers: Gemma 3's pattern (5 sliding, then 1 global at the global base, linear x8)
        kw.update(num_hidden_layers=6, query_pre_attn_scalar=8,
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                      "rope_theta": 1000000.0},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 10000.0}})
        cls = Gemma3ForCausalLM
        config = Gemma3TextConfig(**{**kw, **overrides})
    else:
        raise ValueError(f"family={family}: gemma2 or gemma3")
    torch.manual_seed(0)
    cls(config).save_pretrained(path)
    return path


def case_model(path: Path | str) -> dict[str, Any]:
    """The NUTP model of the HF config at ``path``, as Bridge's provider declares it and
    ``bridge_run.model_config_of`` translates it (every ``ModelConfig`` field)."""
    from nemo_nutp.integrations.bridge_run import model_config_of

    provider = _bridge(path).to_megatron_provider(load_weights=False)
    cfg = model_config_of(provider, vocab_size=json.loads(
        (Path(path) / "config.json").read_text())["vocab_size"])
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def _bridge(path: Path | str) -> Any:
    from nemo_nutp.compat.bridge_cpu import install_import_shim

    install_import_shim()
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_pretrained(str(path), torch_dtype=torch.float32)


def _hf_model(path: Path | str, overrides: dict[str, Any]) -> Any:
    """transformers' model of ``path``'s config (``overrides``: a negative control's fields),
    eager attention (the one that softcaps), fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    switches = {k: v for k, v in overrides.items() if k in SWITCHES}
    for k, v in overrides.items():
        if k not in SWITCHES:
            setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.float32)
    for name in switches:
        SWITCHES[name](model)
    return model.float().train()


def _plain_gamma(model: Any) -> None:
    """Negative control: every RMSNorm scales by ``w``, not Gemma's ``1 + w``."""
    import types

    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        return (self._norm(x.float()) * self.weight.float()).type_as(x)

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(forward, m)


def _no_post_norms(model: Any) -> None:
    """Negative control: the post-attention and post-MLP norms pass their input through."""
    for layer in model.model.layers:
        for m in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            m.forward = lambda x: x


def _no_embedding_scaling(model: Any) -> None:
    """Negative control: the embeddings divided by the sqrt(hidden) that Gemma then multiplies
    them by (Gemma 2 in its model's forward, Gemma 3 in its scaled embedding)."""
    scale = model.config.hidden_size ** 0.5
    model.model.embed_tokens.register_forward_hook(lambda _m, _a, out: out / scale)


SWITCHES = {"plain_gamma": _plain_gamma, "no_post_norms": _no_post_norms,
            "no_embedding_scaling": _no_embedding_scaling}
"""``ref_hf`` keys that switch a feature off in transformers' model itself (it has no config
field for them); every other key is an HF config field."""


def _export(bridge: Any, carrier: Any, hf: Any) -> None:
    """The carrier's weights into ``hf`` through Bridge's export; every HF tensor written."""
    state = {k: v.detach().clone() for k, v in
             bridge.export_hf_weights([carrier], cpu=True, show_progress=False)}
    own = hf.state_dict()
    want = {k for k in own if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    assert set(state) == want, f"Bridge's export: {sorted(set(state) ^ want)}"
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)
    if hf.config.tie_word_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight


def _import(bridge: Any, carrier: Any, hf: Any, tensors: dict[str, torch.Tensor],
            folder: Path) -> dict[str, torch.Tensor]:
    """HF-named ``tensors`` (gradients or parameters) by megatron name: saved as an HF model
    folder, loaded into the carrier by Bridge's ``load_hf_weights``; every carrier parameter
    written (each is NaN before)."""
    with torch.no_grad():
        for k, p in hf.named_parameters():
            p.copy_(tensors[k])
        for p in carrier.parameters():
            p.fill_(float("nan"))
    hf.save_pretrained(folder)
    bridge.load_hf_weights([carrier], str(folder))
    out = {normalize_name(k): p.detach().float().clone() for k, p in carrier.named_parameters()}
    unset = [k for k, v in out.items() if torch.isnan(v).any()]
    assert not unset, f"Bridge's import left {unset} unset"
    return out


def run_hf_reference(case: Any) -> dict[str, Any]:
    """Train ``case`` on transformers' model of ``case.hf_path`` (see the module docstring);
    the same record as ``reference.run_reference``."""
    from nemo_nutp.config import ModelConfig

    from .reference import _build, _step_batches

    dims = ModelConfig(**case.model)
    assert case.precision == "fp32" and not case.schedule and not case.weight_decay
    _, _, carrier = _build(case, dims)  # stock megatron-core with the NUTP initial weights
    bridge = _bridge(case.hf_path)
    hf = _hf_model(case.hf_path, case.ref_hf)
    _export(bridge, carrier, hf)
    params = [p for p in hf.parameters()]  # the tied embedding once
    if case.optimizer == "sgd":
        opt: Any = torch.optim.SGD(params, lr=case.lr, momentum=0.9)  # megatron's sgd_momentum
    else:
        opt = torch.optim.AdamW(params, lr=case.lr, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=0.0)
    out: dict[str, Any] = {"losses": [], "grad_norms": [], "skipped": [], "lrs": [],
                           "val_losses": {}}
    grads: dict[str, torch.Tensor] = {}
    for step in range(case.steps):
        batches = _step_batches(case, dims, step, None)
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for mb in batches:
            logits = hf(input_ids=mb["tokens"], position_ids=mb["position_ids"]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   mb["labels"].reshape(-1))
            (loss / len(batches)).backward()
            total += float(loss.detach())
        if step == 0:
            grads = {k: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                     for k, p in hf.named_parameters()}  # (None: unused in a control)
        if case.clip_grad:
            norm = torch.nn.utils.clip_grad_norm_(params, case.clip_grad)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params
                                                         if p.grad is not None]))
        out["lrs"].append(case.lr)
        opt.step()
        out["losses"].append(total / len(batches))
        out["grad_norms"].append(float(norm))
        out["skipped"].append(False)
    final = {k: p.detach().clone() for k, p in hf.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        out["grads"] = _import(bridge, carrier, hf, grads, Path(tmp) / "grads")
        out["params"] = _import(bridge, carrier, hf, final, Path(tmp) / "params")
    return out
