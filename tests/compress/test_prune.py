"""Structured pruning: target resolution, exact removal, slicing, importance ordering, plans."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from slimserve.compress.errors import RecipeError
from slimserve.compress.model_size import count_parameters
from slimserve.compress.prune.importance import (
    activation_importance,
    block_influence,
    head_norms,
    layer_perplexity_scores,
    magnitude_importance,
)
from slimserve.compress.prune.sizes import Dims, Targets, resolve_dims
from slimserve.compress.prune.stages import compose_teacher_map
from slimserve.compress.prune.structured import (
    apply_plan,
    choose_heads,
    expected_parameters,
    make_plan,
    top_k,
)
from slimserve.compress.stage import TeacherMap

DEMO = Dims(
    hidden_size=384,
    intermediate_size=1024,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    num_layers=4,
)
VOCAB = 96


def tiny(layers=3, heads=4, kv=2, hidden=64, ffn=128, seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains, so hidden slicing through norms is exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def plan_from(model, after: Dims, heads=None, channels=None, hidden=None, layers=None):
    """A plan for `model` with the given scores (default: the earlier index is the more important)."""
    before = Dims.from_config(model.config)
    L, n_q, F, H = (
        before.num_layers,
        before.num_attention_heads,
        before.intermediate_size,
        before.hidden_size,
    )
    heads = heads if heads is not None else -torch.arange(n_q, dtype=torch.float).repeat(L, 1)
    channels = (
        channels if channels is not None else -torch.arange(F, dtype=torch.float).repeat(L, 1)
    )
    hidden = hidden if hidden is not None else -torch.arange(H, dtype=torch.float)
    layers = layers if layers is not None else -torch.arange(L, dtype=torch.float)
    return make_plan(before, after, heads, channels, hidden, layers)


# ---- target resolution ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "targets,expect",
    [
        (Targets(mlp=0.3), {"intermediate_size": 704}),  # 716.8 -> nearest multiple of 64
        (Targets(intermediate_size=768), {"intermediate_size": 768}),
        (
            Targets(heads=0.34),
            {"num_attention_heads": 4, "num_key_value_heads": 2},
        ),  # 2 of 3 per group
        (
            Targets(heads=0.5, heads_mode="kv_groups"),
            {"num_attention_heads": 3, "num_key_value_heads": 1},
        ),
        (
            Targets(num_key_value_heads=1, num_attention_heads=2),
            {"num_attention_heads": 2, "num_key_value_heads": 1},
        ),
        (Targets(hidden=0.5), {"hidden_size": 192}),  # multiple of lcm(64, 6 heads) = 192
        (
            Targets(heads=0.34, hidden=0.25),
            {"hidden_size": 256, "num_attention_heads": 4},
        ),  # lcm(64, 4) = 64
        (Targets(layers=2), {"num_layers": 2}),
        (Targets(layers=0.25), {"num_layers": 3}),
        (Targets(num_layers=3), {"num_layers": 3}),
        (Targets(mlp=0.0, heads=0.0, hidden=0.0, layers=0), {}),
    ],
)
def test_resolve_dims(targets, expect):
    after = resolve_dims(DEMO, targets)
    want = {**DEMO.to_dict(), **expect}
    assert after.to_dict() == want
    assert after.num_attention_heads % after.num_key_value_heads == 0
    assert after.hidden_size % after.num_attention_heads == 0


@pytest.mark.parametrize(
    "targets,needle",
    [
        (Targets(mlp=0.01), "prune.mlp=0.01 removes no channel"),
        (
            Targets(intermediate_size=700),
            "prune.intermediate_size=700 is not a multiple of 64 (multiple_of); use 640 or 704",
        ),
        (
            Targets(intermediate_size=2048),
            "prune.intermediate_size=2048 is not between 1 and the model's 1023",
        ),
        (
            Targets(mlp=0.3, intermediate_size=768),
            "prune.mlp and prune.intermediate_size are both set",
        ),
        (
            Targets(num_attention_heads=5),
            "prune.num_attention_heads=5 cannot keep grouped-query attention",
        ),
        (Targets(num_attention_heads=8, num_key_value_heads=2), "num_attention_heads=8"),
        (
            Targets(num_key_value_heads=3),
            "prune.num_key_value_heads=3 is not between 1 and the model's 2",
        ),
        (Targets(heads=0.1), "prune.heads=0.1 removes no head"),
        (Targets(heads=0.2, heads_mode="kv_groups"), "prune.heads=0.2 removes no KV group"),
        (Targets(hidden_size=320), "prune.hidden_size=320 is not a multiple of 192"),
        (Targets(layers=4), "prune.layers=4 would leave 0 of 4 layers"),
        (Targets(num_layers=5), "prune.num_layers=5 is not between 1 and the model's 4"),
        (Targets(mlp=1.5), "prune.mlp=1.5 is not a fraction in [0, 1)"),
        (Targets(mlp=0.3, multiple_of=2048), "below 2048"),
    ],
)
def test_impossible_targets_are_refused_naming_the_key(targets, needle):
    with pytest.raises(RecipeError) as e:
        resolve_dims(DEMO, targets)
    assert needle in str(e.value)


# ---- exact removal ----------------------------------------------------------------------------


def test_zero_pruning_is_bit_identical():
    model = tiny()
    new = apply_plan(model, plan_from(model, Dims.from_config(model.config)))
    assert new is not model
    ref, got = model.state_dict(), new.state_dict()
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert torch.equal(logits(model), logits(new))


def test_removing_dead_mlp_channels_keeps_the_function():
    model = tiny()
    dead = [3, 7, 8, 100, 127]  # channels whose down_proj column is zero contribute nothing
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[:, dead] = 0
    scores = torch.ones(3, 128)
    scores[:, dead] = 0
    before = Dims.from_config(model.config)
    new = apply_plan(
        model,
        plan_from(
            model,
            resolve_dims(before, Targets(intermediate_size=123, multiple_of=1)),
            channels=scores,
        ),
    )
    assert new.config.intermediate_size == 123
    assert new.model.layers[0].mlp.down_proj.weight.shape == (64, 123)
    torch.testing.assert_close(logits(new), logits(model), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["query", "kv_groups"])
def test_removing_dead_heads_keeps_the_function(mode):
    model = tiny(heads=4, kv=2)  # groups: q heads {0,1} -> kv 0, {2,3} -> kv 1
    dead = [0, 3] if mode == "query" else [2, 3]  # query: one per group; kv_groups: all of group 1
    with torch.no_grad():
        for layer in model.model.layers:
            for h in dead:  # o_proj columns of a head: its whole contribution to the residual
                layer.self_attn.o_proj.weight[:, h * 16 : (h + 1) * 16] = 0
    scores = torch.ones(3, 4)
    scores[:, dead] = 0
    after = resolve_dims(Dims.from_config(model.config), Targets(heads=0.5, heads_mode=mode))
    new = apply_plan(model, plan_from(model, after, heads=scores))
    cfg = new.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (
        (2, 2) if mode == "query" else (2, 1)
    )
    assert cfg.head_dim == 16
    torch.testing.assert_close(logits(new), logits(model), atol=1e-5, rtol=1e-5)


def test_smollm2_attention_shape_loses_a_whole_kv_group_and_a_layer(tmp_path):
    """SmolLM2's shape: 9 query heads over 3 KV heads (3 per group) and tied embeddings. heads 0.34
    in kv_groups mode keeps 2 of the 3 groups (6 / 2); with group 1 (query heads 3-5) and layer 1
    adding nothing, the pruned model computes the same logits, and transformers reloads it."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=144,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:, 3 * 16 : 6 * 16] = (
                0  # group 1's query heads write nothing
            )
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
    scores = torch.ones(3, 9)
    scores[:, 3:6] = 0
    after = resolve_dims(
        Dims.from_config(model.config), Targets(heads=0.34, heads_mode="kv_groups", layers=1)
    )
    assert (after.num_attention_heads, after.num_key_value_heads, after.num_layers) == (6, 2, 2)
    plan = plan_from(model, after, heads=scores, layers=torch.tensor([1.0, 0.0, 1.0]))
    assert [(lp.source, lp.q_heads, lp.kv_heads) for lp in plan.layers] == [
        (0, (0, 1, 2, 6, 7, 8), (0, 2)),
        (2, (0, 1, 2, 6, 7, 8), (0, 2)),
    ]
    new = apply_plan(model, plan)
    assert new.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 144)
    assert new.model.layers[0].self_attn.o_proj.weight.shape == (144, 6 * 16)
    torch.testing.assert_close(logits(new), logits(model), atol=1e-5, rtol=1e-5)
    new.save_pretrained(tmp_path)
    again = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert (
        again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    )  # still tied
    torch.testing.assert_close(logits(again), logits(model), atol=1e-5, rtol=1e-5)


def test_removing_an_identity_layer_keeps_the_function_and_renumbers():
    model = tiny(layers=3)
    with torch.no_grad():  # layer 1 adds nothing to the residual stream
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
    after = resolve_dims(Dims.from_config(model.config), Targets(layers=1))
    new = apply_plan(model, plan_from(model, after, layers=torch.tensor([1.0, 0.0, 1.0])))
    assert new.config.num_hidden_layers == 2 and len(new.model.layers) == 2
    assert [layer.self_attn.layer_idx for layer in new.model.layers] == [0, 1]
    assert torch.equal(
        new.model.layers[1].mlp.up_proj.weight, model.model.layers[2].mlp.up_proj.weight
    )
    torch.testing.assert_close(logits(new), logits(model), atol=1e-5, rtol=1e-5)


def _direct(model, plan) -> LlamaForCausalLM:
    """The smaller model built independently: a fresh config, each weight indexed by hand."""
    a, d = plan.after, plan.before.head_dim
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads,
        head_dim=d,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    small = LlamaForCausalLM(cfg).eval()
    h = list(plan.hidden)

    def rows(heads):
        return [hd * d + j for hd in heads for j in range(d)]

    with torch.no_grad():
        small.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[:, h])
        small.lm_head.weight.copy_(model.lm_head.weight[:, h])
        small.model.norm.weight.copy_(model.model.norm.weight[h])
        for new_layer, lp in zip(small.model.layers, plan.layers):
            old = model.model.layers[lp.source]
            q, kv, ch = rows(lp.q_heads), rows(lp.kv_heads), list(lp.channels)
            sa, oa = new_layer.self_attn, old.self_attn
            sa.q_proj.weight.copy_(oa.q_proj.weight[q][:, h])
            sa.k_proj.weight.copy_(oa.k_proj.weight[kv][:, h])
            sa.v_proj.weight.copy_(oa.v_proj.weight[kv][:, h])
            sa.o_proj.weight.copy_(oa.o_proj.weight[h][:, q])
            new_layer.mlp.gate_proj.weight.copy_(old.mlp.gate_proj.weight[ch][:, h])
            new_layer.mlp.up_proj.weight.copy_(old.mlp.up_proj.weight[ch][:, h])
            new_layer.mlp.down_proj.weight.copy_(old.mlp.down_proj.weight[h][:, ch])
            new_layer.input_layernorm.weight.copy_(old.input_layernorm.weight[h])
            new_layer.post_attention_layernorm.weight.copy_(old.post_attention_layernorm.weight[h])
    return small


@pytest.mark.parametrize(
    "targets",
    [
        Targets(heads=0.5, mlp=0.5, hidden=0.5, layers=1, multiple_of=16),
        Targets(
            heads=0.5, heads_mode="kv_groups", intermediate_size=96, hidden_size=48, multiple_of=16
        ),
    ],
)
def test_pruned_forward_equals_model_built_from_the_kept_slices(targets):
    model = tiny()
    g = torch.Generator().manual_seed(3)  # random scores: kept indices are scattered, not a prefix
    before = Dims.from_config(model.config)
    plan = plan_from(
        model,
        resolve_dims(before, targets),
        heads=torch.rand(3, 4, generator=g),
        channels=torch.rand(3, 128, generator=g),
        hidden=torch.rand(64, generator=g),
        layers=torch.rand(3, generator=g),
    )
    assert plan.hidden != tuple(range(len(plan.hidden)))
    new = apply_plan(model, plan)
    assert torch.equal(logits(new), logits(_direct(model, plan)))
    assert count_parameters(new) == expected_parameters(
        plan.after, VOCAB, tied=False, config=new.config
    )


def test_tied_embeddings_stay_tied_after_hidden_pruning():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    after = resolve_dims(Dims.from_config(cfg), Targets(hidden=0.5, multiple_of=16))
    new = apply_plan(model, plan_from(model, after))
    assert new.lm_head.weight is new.model.embed_tokens.weight
    assert count_parameters(new) == expected_parameters(after, VOCAB, tied=True, config=new.config)


# ---- plans ------------------------------------------------------------------------------------


def test_top_k_and_grouped_head_choice():
    assert top_k(torch.tensor([0.1, 0.9, 0.5, 0.9]), 2) == (1, 3)
    assert top_k(torch.tensor([1.0, 1.0, 1.0]), 2) == (0, 1)  # ties: lower index
    before = DEMO  # 6 heads, groups {0,1,2} {3,4,5}
    scores = torch.tensor([0.1, 0.9, 0.8, 0.2, 0.3, 0.1])
    q, kv = choose_heads(scores, before, resolve_dims(before, Targets(heads=0.34)))
    assert (q, kv) == ((1, 2, 3, 4), (0, 1))  # best two of each group, ascending
    q, kv = choose_heads(
        scores, before, resolve_dims(before, Targets(heads=0.5, heads_mode="kv_groups"))
    )
    assert (q, kv) == ((0, 1, 2), (0,))  # group 0 sums 1.8 > 0.6


def test_teacher_map_composes_over_two_prune_stages():
    model = tiny(layers=3, hidden=64)
    before = Dims.from_config(model.config)
    p1 = plan_from(
        model,
        resolve_dims(before, Targets(layers=1, hidden=0.5, multiple_of=16)),
        layers=torch.tensor([1.0, 0.0, 2.0]),
        hidden=torch.arange(64.0),
    )
    m1 = apply_plan(model, p1)
    first = compose_teacher_map(None, p1)
    assert first == TeacherMap(layers=(0, 2), hidden=tuple(range(32, 64)))
    p2 = plan_from(
        m1,
        resolve_dims(Dims.from_config(m1.config), Targets(layers=1)),
        layers=torch.tensor([0.0, 1.0]),
    )
    assert compose_teacher_map(first, p2) == TeacherMap(layers=(2,), hidden=tuple(range(32, 64)))
    p3 = plan_from(model, before)
    assert compose_teacher_map(None, p3) == TeacherMap(layers=(0, 1, 2), hidden=None)


# ---- importance -------------------------------------------------------------------------------


def test_head_norms_and_block_influence():
    x = torch.zeros(2, 3, 4 * 8)
    x[..., 8:16] = 1.0  # head 1: norm sqrt(8)
    x[..., 24:32] = 2.0  # head 3: norm sqrt(32)
    n = head_norms(x, 4)
    assert n.shape == (2, 3, 4)
    torch.testing.assert_close(n[0, 0], torch.tensor([0.0, 8**0.5, 0.0, 32**0.5]))
    h = torch.randn(5, 16)
    torch.testing.assert_close(block_influence(h, 3 * h), torch.zeros(5), atol=1e-6, rtol=0)
    torch.testing.assert_close(block_influence(h, -h), torch.full((5,), 2.0))
    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    torch.testing.assert_close(block_influence(a, b), torch.ones(1))


def _marked_model():
    """Layer 1 is an identity; in every layer MLP channel 5 is dead and channel 9 is loud; KV
    head 1 (query heads 2, 3) outputs zeros; hidden channel 7 is scaled up everywhere."""
    model = tiny(layers=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[:, 5] = 0
            layer.mlp.up_proj.weight[5] = 0
            layer.mlp.up_proj.weight[9] *= 100
            layer.self_attn.v_proj.weight[16:32] = 0
            layer.input_layernorm.weight[7] = 10.0
            layer.post_attention_layernorm.weight[7] = 10.0
        model.model.layers[1].self_attn.o_proj.weight.zero_()
        model.model.layers[1].mlp.down_proj.weight.zero_()
    return model


def test_activation_importance_orders_what_it_should():
    model = _marked_model()
    imp = activation_importance(model, [torch.randint(0, VOCAB, (2, 16)) for _ in range(2)])
    assert (
        imp.heads.shape == (3, 4) and imp.channels.shape == (3, 128) and imp.hidden.shape == (64,)
    )
    assert (imp.channels.argmin(dim=1) == 5).all() and (imp.channels.argmax(dim=1) == 9).all()
    assert (imp.channels[:, 5] == 0).all()
    assert (imp.heads[:, 2:] == 0).all() and (imp.heads[:, :2] > 0).all()
    assert int(imp.hidden.argmax()) == 7
    assert int(imp.layers.argmin()) == 1 and imp.layers[1].abs() < 1e-6


def test_magnitude_importance_orders_what_it_should():
    model = _marked_model()
    imp = magnitude_importance(model)
    assert imp.layers is None and imp.method == "magnitude"
    assert (imp.channels.argmax(dim=1) == 9).all()
    assert int(imp.hidden.argmax()) == 7
    scale = copy.deepcopy(model)
    with torch.no_grad():  # a head with larger q/o weights scores higher
        scale.model.layers[0].self_attn.o_proj.weight[:, 0:16] *= 10
    assert int(magnitude_importance(scale).heads[0].argmax()) == 0


def test_layer_perplexity_scores_find_the_identity_layer():
    model = _marked_model()
    scores = layer_perplexity_scores(model, [torch.randint(0, VOCAB, (2, 16))])
    assert scores.shape == (3,)
    assert abs(float(scores[1])) < 1e-5  # skipping an identity layer changes nothing
    assert not model.training


# ---- recipe checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stages,needle",
    [
        ("- prune: {}", "stages[0].prune: no pruning target; give at least one of heads, mlp"),
        ("- prune: {mlp: 1.0}", "stages[0].prune.mlp"),
        ("- prune: {mlp: 0.3, heads_mode: groups}", "stages[0].prune.heads_mode"),
        (
            "- rtn: {}\n  - prune: {mlp: 0.3}",
            "stages[1].prune comes after rtn; prune changes the weights",
        ),
        (
            "- distill: {steps: 2}",
            "stages[0].distill: no teacher; the teacher is the model before the first prune",
        ),
        (
            "- prune: {mlp: 0.3}\n  - distill: {kl_weight: 0}",
            "kl_weight, ce_weight and hidden_weight are all 0",
        ),
        ("- prune: {mlp: 0.3}\n  - distill: {steps: 0}", "stages[1].distill.steps"),
        ("- prune: {mlp: 0.3}\n  - distill: {precision: fp16}", "stages[1].distill.precision"),
    ],
)
def test_recipe_refuses_bad_prune_and_distill_stages(stages, needle):
    from slimserve.compress.recipe import parse_recipe

    with pytest.raises(RecipeError) as e:
        parse_recipe(f"model: m\noutput: o\nstages:\n  {stages}\n")
    assert needle in str(e.value)


def test_prune_needs_calibration_only_when_scoring_from_data():
    from slimserve.compress.recipe import parse_recipe

    def needs(stage: str) -> bool:
        return parse_recipe(f"model: m\noutput: o\nstages:\n  - prune: {stage}\n").needs_calibration

    assert needs("{mlp: 0.3}") and needs("{mlp: 0.3, method: magnitude, layers: 1}")
    assert not needs("{mlp: 0.3, method: magnitude}")


@pytest.mark.parametrize(
    "method,layer_method",
    [("magnitude", "perplexity"), ("activation", "cosine"), ("magnitude", "cosine")],
)
def test_prune_stage_scores_layers_as_asked(method, layer_method):
    from slimserve.compress.prune.stages import PruneOptions, PruneStage
    from slimserve.compress.stage import CompressionState

    model = _marked_model()
    calib = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    expect = (
        layer_perplexity_scores(model, list(calib.split(8)))
        if layer_method == "perplexity"
        else activation_importance(model, list(calib.split(8))).layers
    )
    state = CompressionState(model, None, torch.bfloat16, calibration=calib)
    stage = PruneStage(PruneOptions(layers=1, mlp=0.5, method=method, layer_method=layer_method))
    stage.prepare(state)
    stage.apply(state)
    d = stage.finalize(state).details
    imp = d["importance"]
    # on this random model skipping a layer can even help, so the lowest score goes, whichever it is
    assert imp["method"] == method and imp["layers"]["removed"] == [int(expect.argmin())]
    assert imp["layers"]["scores"] == pytest.approx(expect.tolist(), abs=1e-6)
    assert state.model.config.num_hidden_layers == 2 and state.model.config.intermediate_size == 64
    assert d["params_after"] == count_parameters(state.model) < d["params_before"]
    assert int(expect.argmin()) not in state.teacher_map.layers


@pytest.mark.parametrize("config_name", ["Qwen2Config", "Qwen3Config", "MistralConfig"])
def test_other_llama_family_layouts_prune_and_reload(config_name, tmp_path):
    """q/k/v biases (Qwen2), per-head q/k norms and layer_types (Qwen3), Mistral: pruned, saved,
    reloaded by plain transformers with the same logits."""
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    before = Dims.from_config(cfg)
    after = resolve_dims(before, Targets(heads=0.5, mlp=0.5, hidden=0.5, layers=1, multiple_of=16))
    imp = activation_importance(model, [IDS])
    new = apply_plan(
        model, make_plan(before, after, imp.heads, imp.channels, imp.hidden, imp.layers)
    )
    new.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert Dims.from_config(back.config) == after
    assert len(getattr(back.config, "layer_types", None) or [0, 0]) == 2
    assert torch.equal(logits(back), logits(new))
