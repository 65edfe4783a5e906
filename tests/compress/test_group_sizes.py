"""Group sizes that leave a Linear a partial last input group are refused before any work, naming
the Linears and a group size that divides them, unless the recipe allows partial groups
(compress/quant/group_sizes.py, the preflight in compress/pipeline.py)."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from slimserve.compress.errors import RecipeError
from slimserve.compress.pipeline import build_stages, run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.artifact.scheme import SchemeError
from tests.helpers.tiny_model import tiny_tokenizer

# SmolLM2-135M's widths: hidden 576 (9 heads x 64), intermediate 1536. Only shapes are used.
SMOLLM2 = LlamaConfig(
    vocab_size=256,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
)
ATTN_MLP = (
    "model.layers.*.{self_attn.q_proj,self_attn.k_proj,self_attn.v_proj,self_attn.o_proj,"
    "mlp.gate_proj,mlp.up_proj}"
)


def _recipe(
    stages: str,
    export: str = "{format: compressed-tensors}",
    model: str = "some/model",
    tmp_path=None,
    extra: str = "",
):
    text = f"model: {model}\noutput: out\n{extra}stages:\n{stages}\nexport: {export}\n"
    return parse_recipe(text, (tmp_path / "r.yaml") if tmp_path else None)


def test_smollm2_widths_at_group_128_are_refused_naming_64():
    with pytest.raises(RecipeError) as e:
        build_stages(
            _recipe("  - gptq: {scheme: W4A16, group_size: 128}"), SMOLLM2, log=pytest.fail
        )
    msg = str(e.value)
    assert msg.startswith(
        "stages[0].gptq.group_size: 128 does not divide the input width of 12 Linears: "
    )
    assert f"{ATTN_MLP} (in 576)" in msg  # down_proj (in 1536) is a multiple of 128: not named
    assert "use group_size 64 (or 32); 64 divides 576 and 1536" in msg
    assert "set export.allow_partial_groups: true" in msg and "\n" not in msg


def test_group_64_divides_and_passes():
    stages = build_stages(
        _recipe("  - rtn: {scheme: W4A16, group_size: 64}"), SMOLLM2, log=pytest.fail
    )
    assert stages[0].scheme.weights.group_size == 64


def test_only_targeted_linears_count():
    """Ignoring every Linear of width 576 leaves only down_proj, which 128 divides."""
    ignore = "[lm_head, 're:.*(q|k|v|o|gate|up)_proj']"
    build_stages(
        _recipe(f"  - rtn: {{scheme: W4A16, group_size: 128, ignore: {ignore}}}"),
        SMOLLM2,
        log=pytest.fail,
    )


def test_no_power_of_two_divides_suggests_per_channel():
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=100,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=100,
    )
    with pytest.raises(
        RecipeError,
        match="no power-of-two group_size of 8 or more divides 100 and 256; use group_size -1",
    ):
        build_stages(_recipe("  - rtn: {scheme: W4A16, group_size: 32}"), cfg, log=pytest.fail)


def test_opt_in_warns_once_per_stage_and_passes():
    logged = []
    build_stages(
        _recipe("  - rtn: {scheme: W4A16, group_size: 128}", "{allow_partial_groups: true}"),
        SMOLLM2,
        log=logged.append,
    )
    assert len(logged) == 1 and logged[0].startswith("warning: stages[0].rtn.group_size: 128")
    assert "vLLM and transformers (compressed-tensors) refuse this artifact" in logged[0]


def test_gptq_and_awq_formats_cannot_hold_partial_groups():
    # without the opt-in, the refusal does not offer it: these formats cannot hold partial groups
    with pytest.raises(RecipeError) as e:
        build_stages(
            _recipe("  - rtn: {scheme: W4A16, group_size: 128}", "{format: gptq}"),
            SMOLLM2,
            log=pytest.fail,
        )
    assert "use group_size 64" in str(e.value) and "allow_partial_groups" not in str(e.value)
    with pytest.raises(SchemeError, match="gptq checkpoints cannot hold partial groups"):
        build_stages(
            _recipe(
                "  - rtn: {scheme: W4A16, group_size: 64}",
                "{format: gptq, allow_partial_groups: true}",
            ),
            SMOLLM2,
            log=pytest.fail,
        )
    with pytest.raises(SchemeError, match="awq checkpoints cannot hold partial groups"):
        build_stages(
            _recipe(
                "  - rtn: {scheme: W4A16_ASYM, group_size: 64}",
                "{format: awq, allow_partial_groups: true}",
            ),
            SMOLLM2,
            log=pytest.fail,
        )


def test_awq_needs_whole_groups_even_with_the_opt_in():
    stages = "  - awq: {scheme: W4A16, group_size: 128}\n  - rtn: {scheme: W4A16, group_size: 128}"
    with pytest.raises(RecipeError) as e:
        build_stages(_recipe(stages, "{allow_partial_groups: true}"), SMOLLM2, log=pytest.fail)
    assert str(e.value).startswith("stages[0].awq.group_size: 128 does not divide")
    assert "awq needs whole groups even with export.allow_partial_groups" in str(e.value)


def test_widths_after_pruning_are_the_ones_checked():
    """A prune stage before the quantizer changes the widths the group size must divide: a
    recipe valid on the pruned shape passes, and one that pruning breaks names multiple_of."""
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    rtn = "  - rtn: {scheme: W4A16, group_size: 128}"
    with pytest.raises(RecipeError, match=r"model\.layers\.\*\.mlp\.down_proj \(in 192\)"):
        build_stages(_recipe(rtn), cfg, log=pytest.fail)  # unpruned: 192 % 128 != 0
    build_stages(
        _recipe(f"  - prune: {{intermediate_size: 128, multiple_of: 64}}\n{rtn}"),
        cfg,
        log=pytest.fail,
    )
    wide = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    with pytest.raises(RecipeError) as e:  # 384 would pass; the pruned 320 does not
        build_stages(
            _recipe(f"  - prune: {{intermediate_size: 320, multiple_of: 64}}\n{rtn}"),
            wide,
            log=pytest.fail,
        )
    assert "mlp.down_proj (in 320)" in str(e.value) and "or set prune.multiple_of: 128" in str(
        e.value
    )


# A real (tiny) checkpoint with a 96-wide hidden state: group 64 leaves q/k/v/o/gate/up partial.
@pytest.fixture(scope="module")
def narrow_checkpoint(tmp_path_factory):
    from slimserve.runtime.corpus import read_texts

    out = tmp_path_factory.mktemp("narrow-llama")
    tok = tiny_tokenizer(read_texts("validation")[:6])
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


EVAL = "eval: {dataset: stdlib, seq_len: 64, max_windows: 4, max_ppl_increase: 1.0}\n"


def test_cli_refuses_with_one_line_exit_2(tmp_path, narrow_checkpoint):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {narrow_checkpoint}\noutput: {tmp_path / 'art'}\n{EVAL}"
        "stages:\n  - rtn: {scheme: W4A16, group_size: 64}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "slimserve.compress.cli", "run", str(recipe), "--no-progress"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "(in 96)" in lines[0] and "use group_size 32 (or 16); 32 divides 96 and 256" in lines[0]
    assert not (tmp_path / "art").exists()


def test_opt_in_exports_partial_groups_that_load_with_the_reported_ppl(tmp_path, narrow_checkpoint):
    from slimserve.compress.datasets import load_token_documents
    from slimserve.compress.perplexity import evaluate_perplexity
    from slimserve.runtime.loading.loader import load_model

    logged = []
    recipe = _recipe(
        "  - rtn: {scheme: W4A16, group_size: 64}",
        "{allow_partial_groups: true}",
        model=str(narrow_checkpoint),
        tmp_path=tmp_path,
        extra=EVAL,
    )
    res = run_recipe(recipe, log=logged.append, progress=False)
    assert any(
        m.startswith("warning: stages[0].rtn.group_size: 64 does not divide") for m in logged
    )
    manifest = json.loads((res.artifact / "slimserve.json").read_text())
    base = LlamaForCausalLM.from_pretrained(narrow_checkpoint)
    narrow = [
        n
        for n, m in base.named_modules()
        if isinstance(m, torch.nn.Linear) and m.in_features == 96 and n != "lm_head"
    ]
    assert len(narrow) == 12 and manifest["partial_groups"] == narrow
    cfg = json.loads((res.artifact / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 64
    loaded = load_model(
        res.artifact, dtype=torch.float32
    )  # our loader reads the partial groups back
    ids = load_token_documents("stdlib", loaded.tokenizer)
    ppl = evaluate_perplexity(loaded.model, ids, 64, 4, progress=False).ppl
    assert ppl == pytest.approx(res.summary["final"]["ppl"], rel=1e-5)
