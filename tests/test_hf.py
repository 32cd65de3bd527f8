"""Hugging Face transformers models captured into their blocks, planned and run as pipelines.

Tiny configs with random weights (nothing is downloaded).  Every pipeline is compared with the
plain model in eval mode: outputs and every parameter's gradient.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

import autopipe
from autopipe.errors import ChainError
from autopipe.model.capture import CaptureError, CapturedCallError

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 4, 8, 100


def _gpt2(dropout: float = 0.1) -> nn.Module:
    """GPT-2 with its default dropout, or ``dropout=0.0`` so that training runs compare."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout))


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16))


def _bert() -> nn.Module:
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16, num_labels=3))


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=VOCAB,
        decoder_start_token_id=0, pad_token_id=0))


def _bert_mlm() -> nn.Module:
    """Tied input and output embeddings, and an output bias that export lists twice (an alias
    nothing reads, which once merged the whole model into one layer)."""
    return transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16))


def _bart() -> nn.Module:
    """An output bias added through ``.to(device)``, whose check by export (a node nothing reads)
    once merged the whole model into one layer."""
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=2, decoder_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2))


def _tokens(generator: torch.Generator) -> Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)


def _lm_batch(generator: torch.Generator) -> dict[str, Tensor]:
    ids = _tokens(generator)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # a padded sample: the mask must reach every attention
    return {"input_ids": ids, "attention_mask": mask, "labels": _tokens(generator)}


def _classification_batch(generator: torch.Generator) -> dict[str, Tensor]:
    batch = _lm_batch(generator)
    batch["labels"] = torch.randint(0, 3, (BATCH,), generator=generator)
    return batch


#: name → (model factory, batch factory, the block layers the chain must have)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], dict[str, Tensor]], list[str]]] = {
    "gpt2": (_gpt2, _lm_batch, ["transformer.h.0", "transformer.h.1"]),
    "bert": (_bert, _classification_batch, ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
    "bert_mlm": (_bert_mlm, _lm_batch, ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
    "llama": (_llama, _lm_batch, ["model.layers.0", "model.layers.1"]),
    "t5": (_t5, _lm_batch, ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]),
    "bart": (_bart, _lm_batch, ["model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0",
                                "model.decoder.layers.1", "lm_head"]),
}


#: T5's export (encoder and decoder) takes several seconds more than the others
NAMES = [pytest.param(name, marks=pytest.mark.slow) if name == "t5" else name for name in MODELS]


def _setup(name: str, train: bool = False) -> tuple[nn.Module, dict[str, Tensor], list[autopipe.Layer]]:
    """The model (in eval mode unless ``train``), its sample batch and its captured layers."""
    factory, batch, _ = MODELS[name]
    torch.manual_seed(0)
    model = factory().train(train)
    sample = batch(torch.Generator().manual_seed(1))
    return model, sample, _captured(model, sample)


def _captured(model: nn.Module, sample: dict[str, Tensor]) -> list[autopipe.Layer]:
    """``model`` captured on ``sample`` (the use_cache warning silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopipe.chain(model, sample)


def _output_and_grads(run: Callable[..., Any], model: nn.Module, batch: dict[str, Tensor]) -> tuple[Any, dict]:
    model.zero_grad(set_to_none=True)
    out = run(**batch)
    (out.loss + out.logits.square().mean()).backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close(want: Tensor, have: Tensor, what: str) -> None:
    """Relative error within 1e-4 of the reference's largest magnitude, with a floor for
    values that are mathematically zero (float sums over micro-batches reorder additions)."""
    scale = max(want.abs().max().item(), 1e-6)
    error = (want - have).abs().max().item()
    assert error <= 1e-4 * scale, f"{what}: max error {error:.3g} against scale {scale:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_chain_reaches_every_block(name: str) -> None:
    _, _, blocks = MODELS[name]
    model, sample, layers = _setup(name)
    names = [layer.name for layer in layers]
    assert all(block in names for block in blocks), names
    assert sum(p.numel() for layer in layers for p in layer.module.parameters()) >= sum(
        p.numel() for p in model.parameters())  # every parameter is in some layer (tied ones in two)


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_state_dict_is_the_models(name: str) -> None:
    """Same keys (tied weights and export's lifted constants included), loadable both ways."""
    model, _, layers = _setup(name)
    pipe = autopipe.Pipeline(layers, balance=[2, len(layers) - 2], devices=["cpu", "cpu"])
    assert pipe.state_dict().keys() == model.state_dict().keys()
    model.load_state_dict(pipe.state_dict())
    pipe.close()


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_equals_model(name: str, stages: int) -> None:
    _assert_pipeline_equals_model(name, stages)


def test_bart_splits_into_its_blocks_and_runs_as_the_model() -> None:
    """BART adds its output bias through ``.to(device)``: the chain is still its blocks, and the
    bias lives with ``lm_head`` only."""
    _, _, layers = _setup("bart")
    holding = [layer.name for layer in layers if "final_logits_bias" in dict(layer.module.named_buffers())]
    assert holding == ["lm_head"]
    _assert_pipeline_equals_model("bart", 2)


def _assert_pipeline_equals_model(name: str, stages: int) -> None:
    """The pipeline of ``name``'s layers over ``stages`` even stages gives the plain model's
    outputs and gradients."""
    model, sample, layers = _setup(name)
    want, want_grads = _output_and_grads(lambda **batch: model(**batch, use_cache=False), model, sample)
    count = len(layers)
    cuts = [round(count * s / stages) for s in range(stages + 1)]
    balance = [b - a for a, b in zip(cuts, cuts[1:])]
    # chunks=3 splits the 4 samples 2, 1, 1: the loss is joined as a size-weighted mean
    pipe = autopipe.Pipeline(layers, balance=balance, devices=["cpu"] * stages, chunks=stages).eval()
    stage_of = {layer.name: stage.index for stage in pipe.stages for layer in stage.layers}
    if name == "gpt2":  # the tied embedding and output weight on two stages: gradients must add up
        assert stage_of["transformer.wte"] != stage_of["lm_head"]
    have, have_grads = _output_and_grads(pipe, model, sample)
    assert type(have) is type(want)
    assert have.keys() == want.keys()
    for key in want.keys():
        _assert_close(want[key], have[key], key)
    assert have_grads.keys() == want_grads.keys()
    for param, grad in want_grads.items():
        _assert_close(grad, have_grads[param], param)
    pipe.close()


@pytest.mark.slow
def test_plan_from_measured_profile_runs() -> None:
    """partition() profiles the captured GPT-2 on its keyword batch (in train mode, as profiles
    are measured; dropout 0 so that runs compare), plans it on two devices and the planned
    pipeline gives the model's loss and gradients."""
    torch.manual_seed(0)
    model = _gpt2(dropout=0.0)
    sample = _lm_batch(torch.Generator().manual_seed(1))
    want, want_grads = _output_and_grads(lambda **batch: model(**batch, use_cache=False), model, sample)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = autopipe.partition(model, sample, devices=["cpu", "cpu"], chunks=2)
    assert pipe.plan is not None
    have, have_grads = _output_and_grads(pipe, model, sample)
    _assert_close(want.loss, have.loss, "loss")
    for param, grad in want_grads.items():
        _assert_close(grad, have_grads[param], param)
    pipe.close()


@pytest.mark.slow
def test_partition_of_a_model_in_eval_mode_plans_its_training() -> None:
    """``from_pretrained`` returns a model in eval mode: partition captures and profiles it as
    it trains (the export of an eval-mode model refused the profiler's train-mode run), gives
    every module its own mode back, and the pipeline gives the model's training loss and
    gradients."""
    torch.manual_seed(0)
    model = _gpt2(dropout=0.0)
    model.eval()
    model.transformer.h[0].train()  # modes are restored module by module
    modes = [m.training for m in model.modules()]
    sample = _lm_batch(torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = autopipe.partition(model, sample, devices=["cpu", "cpu"], chunks=2, replicas=1)
    assert [m.training for m in model.modules()] == modes
    model.train()
    want, want_grads = _output_and_grads(lambda **batch: model(**batch, use_cache=False), model, sample)
    have, have_grads = _output_and_grads(pipe, model, sample)
    _assert_close(want.loss, have.loss, "loss")
    for param, grad in want_grads.items():
        _assert_close(grad, have_grads[param], param)
    pipe.close()


def test_caches_off_while_capturing_and_restored() -> None:
    model = _t5()  # the decoder keeps its own copy of the config
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()
    before = [config.use_cache for config in configs]
    assert len(configs) > 2 and before.count(True) >= 2  # the model's and the decoder's
    with pytest.warns(UserWarning, match="use_cache=False"):
        layers = autopipe.chain(model, _lm_batch(torch.Generator().manual_seed(1)))
    assert [config.use_cache for config in configs] == before
    assert layers


def test_saving_and_cache_settings_after_the_capture_keep_the_pipeline_running(tmp_path) -> None:
    """``save_pretrained`` writes the config (its ``dtype``, ``architectures``) and ``use_cache``
    does not change a graph captured with caches off: neither is read by the forward (every step
    after a mid-training save was refused, reading the names of every method of the model), while
    ``output_hidden_states``, which the graph does not return, is refused."""
    model = _gpt2()
    batch = _lm_batch(torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="use_cache=False"):
        pipe = autopipe.Pipeline(autopipe.chain(model, batch), balance=[3, 4], devices=["cpu", "cpu"], chunks=2)
    try:
        pipe(**batch).loss.backward()
        model.save_pretrained(tmp_path)
        model.config.use_cache = not model.config.use_cache
        pipe(**batch).loss.backward()
        model.config.output_hidden_states = True
        with pytest.raises(ChainError, match="output_hidden_states was False when the model was captured"):
            pipe(**batch)
    finally:
        pipe.close()


def test_keyword_arguments_must_match_the_capture() -> None:
    model, sample, layers = _setup("gpt2")
    pipe = autopipe.Pipeline(layers, balance=[len(layers) - 3, 3], devices=["cpu", "cpu"])
    without_labels = {k: v for k, v in sample.items() if k != "labels"}
    with pytest.raises(TypeError, match=r"captured with keyword arguments \['input_ids', 'attention_mask', 'labels'\]"):
        pipe(**without_labels)
    with pytest.raises(TypeError, match="captured with keyword arguments"):
        pipe(**sample, token_type_ids=sample["input_ids"])
    pipe.close()


def test_a_positional_call_is_told_to_pass_the_captured_keywords() -> None:
    _, sample, layers = _setup("gpt2")
    pipe = autopipe.Pipeline(layers, balance=[len(layers) - 3, 3], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"called with 1 positional argument and the keyword arguments \[\]; pass "
                                        r"them by keyword, as captured \(pipe\(input_ids=..., attention_mask=..., "
                                        r"labels=...\) or pipe\(\*\*batch\)\)"):
        pipe(sample["input_ids"])
    pipe.close()


def test_labels_captured_as_the_input_ids_tensor_stay_their_own_input() -> None:
    """Captured as the README does, ``labels=ids`` (one tensor for two arguments, which export made
    one input), the pipeline reads the labels a call gives: other tokens, and -100 where masked."""
    torch.manual_seed(0)
    model = _gpt2(dropout=0.0).eval()
    generator = torch.Generator().manual_seed(1)
    ids = _tokens(generator)
    layers = _captured(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    pipe = autopipe.Pipeline(layers, balance=[len(layers) - 3, 3], devices=["cpu", "cpu"], chunks=2)
    labels = _tokens(generator)
    labels[:, :3] = -100
    batch = {"input_ids": _tokens(generator), "attention_mask": torch.ones_like(ids), "labels": labels}
    want, want_grads = _output_and_grads(lambda **batch: model(**batch, use_cache=False), model, batch)
    have, have_grads = _output_and_grads(pipe, model, batch)
    for key in ("loss", "logits"):
        _assert_close(want[key], have[key], key)
    for param, grad in want_grads.items():
        _assert_close(grad, have_grads[param], param)
    pipe.close()


def test_labels_give_the_models_own_loss() -> None:
    """Without labels there is no loss; with them it is the model's (the causal shift included)."""
    model, sample, _ = _setup("gpt2")
    without_labels = {k: v for k, v in sample.items() if k != "labels"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layers = autopipe.chain(model, without_labels)
    pipe = autopipe.Pipeline(layers, balance=[len(layers) - 2, 2], devices=["cpu", "cpu"], chunks=2).eval()
    with torch.no_grad():
        out = pipe(**without_labels)
        assert out.loss is None
        _assert_close(model(**without_labels, use_cache=False).logits, out.logits, "logits")
    pipe.close()


def test_a_transformers_model_needs_a_sample_batch() -> None:
    with pytest.raises(CaptureError, match=r"give one, e.g. autopipe.chain\(model, \{'input_ids'"):
        autopipe.chain(_gpt2())


def test_another_sequence_length_is_refused() -> None:
    """The exported graph keeps the sample's sequence length: a call with another is an error,
    never a silently reshaped run."""
    _, sample, layers = _setup("gpt2")
    pipe = autopipe.Pipeline(layers, balance=[len(layers) - 2, 2], devices=["cpu", "cpu"])
    longer = {name: torch.cat([value, value], dim=1) for name, value in sample.items()}
    with pytest.raises(ValueError, match=r"captured with torch.export on inputs of sizes \[\(8,\), \(8,\), \(8,\)\]"):
        pipe(**longer)
    pipe.close()


def test_profile_takes_a_keyword_sample() -> None:
    """autopipe.profile reads a mapping sample as the captured first layer's keyword arguments
    (the model in train mode, as profiles are measured)."""
    model, sample, layers = _setup("gpt2", train=True)
    measured = autopipe.profile(layers, sample, devices=["cpu"], batch_sizes=[2, 4], warmup=0, repeats=1,
                                copy_sizes=[1024], quiet=True)
    assert measured.batch_size == BATCH and [layer.name for layer in measured.layers] == [
        layer.name for layer in layers]
    assert measured.input_bytes == sum(t.element_size() * t.numel() for t in sample.values()) // BATCH


@pytest.mark.parametrize("interleave", [1, 2])
def test_1f1b_train_step_takes_the_models_call_and_its_loss(interleave: int) -> None:
    """``pipe.train_step(**batch, loss_fn=lambda out, _: out.loss)`` trains a 1F1B pipeline as the
    model is called: keyword arguments, the model's own output per micro-batch, no target (it
    took positional inputs only and gave ``loss_fn`` the last layer's flat tuple).  In float64,
    checkpointing all but the last micro-batch, the loss and gradients are the plain model's."""
    torch.manual_seed(0)
    model = _gpt2(dropout=0.0).double()
    reference = copy.deepcopy(model)
    sample = _lm_batch(torch.Generator().manual_seed(1))
    balance = [3, 4] if interleave == 1 else [2, 2, 2, 1]
    # chunks=3 splits the 4 samples 2, 1, 1: every sample counts 7 labelled tokens, so the
    # micro-batches' token means weighted by their sample counts are the batch's token mean
    pipe = autopipe.Pipeline(_captured(model, sample), balance=balance, devices=["cpu", "cpu"], chunks=3,
                             schedule="1f1b", interleave=interleave)
    seen: list[tuple[type, Any]] = []

    def own_loss(out: Any, target: Any) -> Tensor:
        seen.append((type(out), target))
        return out.loss

    loss = pipe.train_step(**sample, loss_fn=own_loss)
    want = reference(**sample, use_cache=False)
    want.loss.backward()
    assert set(seen) == {(type(want), None)}  # each micro-batch's, and again in its recomputation
    _assert_close(want.loss.detach(), loss, "loss")
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        _assert_close(expected[name].grad, param.grad, name)
    pipe.close()


def test_an_input_of_another_dtype_is_refused() -> None:
    """The exported graph keeps the sample's dtypes: a bool mask where the capture saw int64 failed
    inside the graph with "Tensor dtype mismatch! Expected: Long, Got: bool", naming nothing."""
    _, sample, layers = _setup("gpt2")
    pipe = autopipe.Pipeline(layers, balance=[len(layers) - 2, 2], devices=["cpu", "cpu"], chunks=2)
    with torch.no_grad(), pytest.raises(CapturedCallError, match=r"called with 'attention_mask' of torch.bool "
                                                                 r"\(captured as torch.int64\); pass each in its "
                                                                 r"captured dtype"):
        pipe(**dict(sample, attention_mask=sample["attention_mask"].bool()))
    pipe.close()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_model_converted_after_its_capture_is_refused(name: str) -> None:
    """Where the model converts a value (GPT-2's ``position_embeds.to(device)``, Llama's rotary
    ``inv_freq.to(dtype=torch.float)``) the graph checks the capture's dtype: after
    ``pipe.double()`` that check failed with "Tensor dtype mismatch! Expected: Float, Got:
    double"; now the error says the model was converted, and to convert it before capturing."""
    _, sample, layers = _setup(name)
    pipe = autopipe.Pipeline(layers, balance=[len(layers) - 2, 2], devices=["cpu", "cpu"]).double()
    with torch.no_grad(), pytest.raises(CapturedCallError, match=r"was torch.float32 at the capture and is "
                                                                 r"torch.float64 now\. The model was converted since "
                                                                 r"\('[\w.]+' is torch.float64 .*convert it before "
                                                                 r"capturing it"):
        pipe(**sample)
    pipe.close()


def test_another_autocast_is_refused_until_captured_under_it() -> None:
    """GPT-2's loss converts the logits with ``.float()``, which the graph captured without
    autocast checks as float32: under bfloat16 autocast that failed with "Tensor dtype mismatch!
    Expected: Float, Got: c10::BFloat16"; now the error names the autocast, and a capture under
    it gives the model's loss, logits and gradients under it."""
    model, sample, layers = _setup("gpt2")
    pipe = autopipe.Pipeline(layers, balance=[len(layers) - 2, 2], devices=["cpu", "cpu"])
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            CapturedCallError, match=r"Autocast is on for cpu \(bfloat16\) here and was off at the capture: capture "
                                     r"the model under the autocast it runs with"):
        pipe(**sample)
    pipe.close()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layers = _captured(model, sample)
    _assert_same_under_autocast(model, sample, layers)


def test_a_graph_without_dtype_checks_runs_under_autocast_as_the_model() -> None:
    """BERT's graph checks no floating-point dtype: captured without autocast, it runs under it as
    the model does, nothing refused."""
    model, sample, layers = _setup("bert")
    _assert_same_under_autocast(model, sample, layers)


def _assert_same_under_autocast(model: nn.Module, sample: dict[str, Tensor], layers: list[autopipe.Layer]) -> None:
    """Under bfloat16 autocast, a pipeline of ``layers`` gives ``model``'s outputs and gradients
    (one micro-batch: bfloat16 rounds a split batch's products otherwise)."""
    pipe = autopipe.Pipeline(layers, balance=[len(layers) - 2, 2], devices=["cpu", "cpu"], chunks=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _output_and_grads(lambda **batch: model(**batch, use_cache=False), model, sample)
        have, have_grads = _output_and_grads(pipe, model, sample)
    assert have.logits.dtype == want.logits.dtype == torch.bfloat16
    for key in ("loss", "logits"):
        _assert_close(want[key].float(), have[key].float(), key)
    assert have_grads.keys() == want_grads.keys()
    for param, grad in want_grads.items():
        _assert_close(grad, have_grads[param], param)
    pipe.close()
