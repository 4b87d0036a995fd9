"""PrecisionPlan: parsing the `precision:` section, selectors, precedence, resolve errors."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch.nn as nn

from lowprec.numerics.formats import FORMATS, get_format
from lowprec.sites.plan import (ModelInfo, PlanError, PrecisionPlan, ReasonKind, Rule, Selector, make_ladder,
                          selection_from_dict)
from lowprec.sites.resolution import SitePlan, format_plan_table, is_linear, linear_shape, resolve

BF16, FP8, NVFP4 = FORMATS["bf16"], FORMATS["fp8_tensorwise"], FORMATS["nvfp4"]


# --- a small GPT-like model: embedding, blocks (attn: qkv, proj; mlp: fc, proj), lm_head ---

class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d), nn.LayerNorm(d), MLP(d)


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, d=32, n_blocks=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)


def linear_fqns(n_blocks=4):
    return [f"blocks.{i}.{m}" for i in range(n_blocks)
            for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")] + ["lm_head"]


EXAMPLE = """
model: {name: tiny}          # other sections of a training config are not the plan's business
precision:
  backend: emulated
  default: bf16
  keep_high_precision:
    - {module_type: Embedding}
    - {fqns: [lm_head]}
    - {first_layers: 1}
    - {last_layers: 1}
  rules:
    - name: mlp_fp8
      select: {glob: "blocks.*.mlp.*"}
      format: fp8_tensorwise
    - name: middle_mlp_fp4
      select: {glob: "blocks.*.mlp.*", last_layers: 2}
      format: nvfp4
      ladder: [nvfp4, fp8_tensorwise, bf16]
"""


def by_fqn(sites):
    return {s.fqn: s for s in sites}


def plan_of(**precision):
    return PrecisionPlan.from_dict(precision)


def errmsg(exc_info):
    return str(exc_info.value)


# --- parsing ---

def test_example_parses_into_typed_frozen_objects():
    plan = PrecisionPlan.from_yaml(EXAMPLE)
    assert plan.backend == "emulated" and plan.default is BF16 and plan.fused is False
    assert plan.keep_high_precision == (Selector(module_type="Embedding"), Selector(fqns=("lm_head",)),
                                        Selector(first_layers=1), Selector(last_layers=1))
    r0, r1 = plan.rules
    assert (r0.name, r0.format, r0.ladder) == ("mlp_fp8", FP8, (FP8, BF16))
    assert r1.select == Selector(glob="blocks.*.mlp.*", last_layers=2)
    assert r1.ladder == (NVFP4, FP8, BF16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.backend = "torch"
    with pytest.raises(dataclasses.FrozenInstanceError):
        r0.select.glob = "*"


def test_defaults_and_empty_section():
    plan = PrecisionPlan.from_dict({})
    assert plan == PrecisionPlan() and plan.backend == "emulated" and plan.default is BF16
    assert plan.rules == () and plan.keep_high_precision == ()


def test_yaml_round_trip(tmp_path):
    plan = PrecisionPlan.from_yaml(EXAMPLE)
    again = PrecisionPlan.from_yaml(plan.to_yaml())
    assert again == plan
    path = tmp_path / "train.yaml"
    path.write_text(plan.to_yaml())
    assert PrecisionPlan.from_yaml(path) == plan and PrecisionPlan.from_yaml(str(path)) == plan
    full = plan_of(backend="torch", default="fp8_rowwise", fused=True,
                   rules=[{"select": {"regex": r"blocks\.\d+\.attn\..*", "module_type": "Attention"},
                           "format": "mxfp8"}])
    assert PrecisionPlan.from_yaml(full.to_yaml()) == full
    assert full.rules[0].name == "rules[0]"  # unnamed rules are named by their position


def test_ladder_normalization():
    assert make_ladder(NVFP4) == (NVFP4, BF16)
    assert make_ladder(BF16) == (BF16,)
    assert make_ladder(NVFP4, (FP8,)) == (NVFP4, FP8, BF16)              # format prepended, bf16 appended
    assert make_ladder(NVFP4, (NVFP4, FP8, BF16)) == (NVFP4, FP8, BF16)  # already complete
    assert Rule(Selector(glob="*"), FP8).ladder == (FP8, BF16)


@pytest.mark.parametrize("fmt, ladder, bad", [
    ("fp8_tensorwise", ["nvfp4", "bf16"], "nvfp4 (4 bits) comes after fp8_tensorwise (8 bits)"),
    ("nvfp4", ["nvfp4", "bf16", "fp8_tensorwise"], "fp8_tensorwise (8 bits) comes after bf16 (16 bits)"),
    ("nvfp4", ["nvfp4", "mxfp4"], "mxfp4 (4 bits) comes after nvfp4 (4 bits)"),
    ("nvfp4", ["fp8_tensorwise", "fp8_rowwise"], "fp8_rowwise (8 bits) comes after fp8_tensorwise (8 bits)"),
])
def test_ladder_out_of_order_is_an_error(fmt, ladder, bad):
    with pytest.raises(PlanError) as e:
        plan_of(rules=[{"select": {"glob": "x"}, "format": fmt, "ladder": ladder}])
    assert e.value.path == "precision.rules[0].ladder"
    assert bad in errmsg(e) and "low to high precision" in errmsg(e)


# --- load-time errors ---

@pytest.mark.parametrize("section, path, fragments", [
    ({"backnd": "torch"}, "precision.backnd", ["unknown key 'backnd'", "Did you mean 'backend'", "Allowed keys:",
                                               "keep_high_precision"]),
    ({"rules": [{"select": {"glob": "*"}, "fromat": "nvfp4"}]}, "precision.rules[0].fromat",
     ["unknown key 'fromat'", "Did you mean 'format'", "Allowed keys: select, format, ladder, name"]),
    ({"keep_high_precision": [{"last_layer": 1}]}, "precision.keep_high_precision[0].last_layer",
     ["Did you mean 'last_layers'", "glob, regex, fqns, first_layers, last_layers, module_type"]),
    ({"rules": [{"select": {"glob": "*"}, "format": "nvfp8"}]}, "precision.rules[0].format",
     ["unknown precision format 'nvfp8'", "Did you mean", "Known formats:", "fp8_tensorwise", "mxfp4"]),
    ({"rules": [{"select": {"glob": "*"}, "format": "nvfp4", "ladder": ["nvfp4", "fp8"]}]},
     "precision.rules[0].ladder[1]", ["unknown precision format 'fp8'", "Known formats:"]),
    ({"default": "bf61"}, "precision.default", ["'bf61'", "Did you mean 'bf16'"]),
    ({"default": 8}, "precision.default", ["expected a format name, found the integer 8", "Known formats:"]),
    ({"keep_high_precision": [{"first_layers": "two"}]}, "precision.keep_high_precision[0].first_layers",
     ["expected an integer or null", "found the string 'two'"]),
    ({"keep_high_precision": [{"last_layers": 0}]}, "precision.keep_high_precision[0].last_layers",
     ["integer >= 1", "found int 0"]),
    ({"keep_high_precision": [{"first_layers": True}]}, "precision.keep_high_precision[0].first_layers",
     ["found the boolean true"]),
    ({"keep_high_precision": [{"fqns": "lm_head"}]}, "precision.keep_high_precision[0].fqns",
     ["expected a list of strings or null", "found the string 'lm_head'", "write a list"]),
    ({"keep_high_precision": [{"glob": 3}]}, "precision.keep_high_precision[0].glob",
     ["expected a string or null", "found the integer 3"]),
    ({"keep_high_precision": [{"regex": "blocks.(["}]}, "precision.keep_high_precision[0].regex",
     ["invalid regular expression"]),
    ({"keep_high_precision": [{}]}, "precision.keep_high_precision[0]", ["empty selector selects nothing"]),
    ({"keep_high_precision": {"fqns": ["lm_head"]}}, "precision.keep_high_precision", ["expected a list"]),
    ({"rules": [{"select": {"glob": "*"}}]}, "precision.rules[0].format", ["missing required key format"]),
    ({"rules": [{"format": "nvfp4"}]}, "precision.rules[0].select", ["missing required key select"]),
    ({"rules": [{"select": "blocks.*", "format": "nvfp4"}]}, "precision.rules[0].select",
     ["expected a mapping", "found the string 'blocks.*'"]),
    ({"rules": [{"name": "a", "select": {"glob": "*"}, "format": "nvfp4"},
                {"name": "a", "select": {"glob": "*"}, "format": "bf16"}]}, "precision.rules[1].name",
     ["duplicate rule name 'a'"]),
    ({"backend": "tourch"}, "precision.backend", ["unknown backend 'tourch'", "Did you mean 'torch'",
                                                  "emulated, torch, te"]),
    ({"fused": "yes"}, "precision.fused", ["expected true or false", "found the string 'yes'"]),
])
def test_load_errors_name_the_path_what_was_found_and_what_is_allowed(section, path, fragments):
    with pytest.raises(PlanError) as e:
        PrecisionPlan.from_dict(section)
    assert isinstance(e.value, ValueError)
    assert e.value.path == path
    assert str(e.value).startswith(f"{path}: ")
    for f in fragments:
        assert f in errmsg(e), (f, errmsg(e))


def test_from_yaml_errors(tmp_path):
    with pytest.raises(PlanError, match="no `precision:` section; found top-level keys model, rollout"):
        PrecisionPlan.from_yaml("model: {}\nrollout: {}\n")
    with pytest.raises(PlanError, match="there is no such file"):
        PrecisionPlan.from_yaml(str(tmp_path / "missing.yaml"))
    with pytest.raises(PlanError, match="not valid YAML"):
        PrecisionPlan.from_yaml("precision: {backend: [\n")
    with pytest.raises(PlanError) as e:
        PrecisionPlan.from_yaml("precision:\n  rules:\n    - {select: {glob: '*'}, format: nvfp4}\n"
                                "    - {select: {first_layers: two}, format: nvfp4}\n")
    assert e.value.path == "precision.rules[1].select.first_layers"


def test_selection_from_dict_is_reusable_and_checks_keys():
    sel = selection_from_dict({"glob": "blocks.*", "last_layers": 2}, "rollout.stages[0].select")
    assert sel == Selector(glob="blocks.*", last_layers=2)
    with pytest.raises(PlanError) as e:
        selection_from_dict({"globb": "*"}, "rollout.stages[0].select")
    assert e.value.path == "rollout.stages[0].select.globb" and "Did you mean 'glob'" in errmsg(e)


# --- selectors on the small model ---

def selected(model, sel):
    info = ModelInfo.of(model)
    return [f for f, m in info.modules.items() if is_linear(m, f) and sel.matches(f, m, info)]


def test_glob_regex_fqns():
    m = TinyGPT()
    assert selected(m, Selector(glob="blocks.*.mlp.*")) == [f"blocks.{i}.mlp.{n}" for i in range(4)
                                                            for n in ("fc", "proj")]
    assert selected(m, Selector(glob="*proj")) == [f for f in linear_fqns() if f.endswith("proj")]
    # regex is a full match: no substring matching
    assert selected(m, Selector(regex="mlp")) == []
    assert selected(m, Selector(regex=r"blocks\.[12]\.attn\.qkv")) == ["blocks.1.attn.qkv", "blocks.2.attn.qkv"]
    assert selected(m, Selector(fqns=("lm_head", "blocks.0.mlp.fc"))) == ["blocks.0.mlp.fc", "lm_head"]
    assert selected(m, Selector(fqns=("blocks.0.mlp",))) == []  # a prefix is not a match


def test_first_and_last_layers_count_blocks():
    m = TinyGPT(n_blocks=4)
    assert selected(m, Selector(first_layers=1)) == linear_fqns()[:4]
    assert selected(m, Selector(last_layers=2)) == linear_fqns()[8:16]
    assert selected(m, Selector(first_layers=9)) == linear_fqns()[:16]  # lm_head is in no block
    info = ModelInfo.of(m)
    assert info.block("blocks.3.mlp.fc") == (3, 4) and info.block("blocks.0") == (0, 4)
    assert info.block("lm_head") is None and info.block("embed") is None


def test_block_detection_nested_lists_and_moduledict():
    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE()

    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): Layer() for i in (10, 2, 1)})  # torchtitan-style, integer keys
    info = ModelInfo.of(model)
    assert info.block("layers.1.moe.experts.7") == (0, 3)   # the outermost list counts, not the experts
    assert info.block("layers.10.moe.experts.0") == (2, 3)  # integer order, not string order
    assert selected(model, Selector(last_layers=1)) == [f"layers.10.moe.experts.{i}" for i in range(8)]


def test_module_type_matches_the_module_or_its_parent():
    m = TinyGPT()
    attn = [f for f in linear_fqns() if ".attn." in f]
    assert selected(m, Selector(module_type="Attention")) == attn
    assert selected(m, Selector(module_type=f"{Attention.__module__}.Attention")) == attn
    assert selected(m, Selector(module_type="torch.nn.modules.linear.Linear")) == linear_fqns()
    info = ModelInfo.of(m)
    assert Selector(module_type="Embedding").matches("embed", m.embed, info)
    assert not Selector(module_type="Block").matches("blocks.0.attn.qkv", m.blocks[0].attn.qkv, info)  # parent only


def test_module_type_includes_base_classes():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(16, 16), nn.Linear(16, 16))
    assert selected(model, Selector(module_type="MyLinear")) == ["0"]
    assert selected(model, Selector(module_type="Linear")) == ["0", "1"]


def test_selectors_built_in_python():
    assert Selector(fqns=["a", "b"]).fqns == ("a", "b")  # a list is kept as a tuple (hashable, frozen)
    assert hash(Selector(fqns=["a"])) == hash(Selector(fqns=("a",)))
    with pytest.raises(PlanError, match="empty selector selects nothing"):
        Selector()
    assert Rule(Selector(glob="*"), NVFP4, [FP8]).ladder == (NVFP4, FP8, BF16)


def test_zero_blocks_is_rejected_at_load():
    # `first_layers: 0` would select nothing: say so when the config is read, not at resolve time
    with pytest.raises(PlanError) as e:
        plan_of(rules=[{"name": "mid", "select": {"glob": "blocks.*.mlp.*", "first_layers": 0}, "format": "nvfp4"}])
    assert e.value.path == "precision.rules[0].select.first_layers" and "found int 0" in errmsg(e)


def test_first_matching_keep_selector_is_the_reason():
    plan = plan_of(keep_high_precision=[{"first_layers": 1}, {"glob": "blocks.0.*"}])
    assert str(by_fqn(resolve(TinyGPT(), plan))["blocks.0.mlp.fc"].reason) == "keep_high_precision (first_layers 1)"


def test_and_combination():
    m = TinyGPT()
    assert selected(m, Selector(glob="*.mlp.*", last_layers=2)) == [
        "blocks.2.mlp.fc", "blocks.2.mlp.proj", "blocks.3.mlp.fc", "blocks.3.mlp.proj"]
    assert selected(m, Selector(module_type="MLP", first_layers=1, regex=r".*\.fc")) == ["blocks.0.mlp.fc"]
    assert selected(m, Selector(first_layers=1, last_layers=1)) == []
    assert Selector(glob="*.mlp.*", last_layers=2).describe() == "glob *.mlp.* and last_layers 2"
    assert Selector(fqns=("a", "b")).describe() == "fqns a, b"


# --- resolve: precedence and reasons ---

def test_resolve_example_precedence_and_reasons():
    sites = resolve(TinyGPT(n_blocks=4), PrecisionPlan.from_yaml(EXAMPLE))
    assert [s.fqn for s in sites] == linear_fqns()
    s = by_fqn(sites)
    # keep_high_precision beats every rule: block 0 and 3 (first/last) and lm_head stay bf16
    assert s["blocks.0.mlp.fc"].format is BF16 and s["blocks.0.mlp.fc"].ladder == (BF16,)
    assert str(s["blocks.0.mlp.fc"].reason) == "keep_high_precision (first_layers 1)"
    assert str(s["blocks.3.mlp.proj"].reason) == "keep_high_precision (last_layers 1)"
    assert str(s["lm_head"].reason) == "keep_high_precision (fqns lm_head)"
    # the last matching rule wins: block 2 (in the last 2) gets nvfp4, block 1 fp8
    assert s["blocks.2.mlp.fc"].format is NVFP4 and s["blocks.2.mlp.fc"].ladder == (NVFP4, FP8, BF16)
    assert str(s["blocks.2.mlp.fc"].reason) == "rule middle_mlp_fp4 (glob blocks.*.mlp.* and last_layers 2)"
    assert s["blocks.1.mlp.proj"].format is FP8 and s["blocks.1.mlp.proj"].ladder == (FP8, BF16)
    assert str(s["blocks.1.mlp.proj"].reason) == "rule mlp_fp8 (glob blocks.*.mlp.*)"
    assert s["blocks.1.attn.qkv"].format is BF16 and str(s["blocks.1.attn.qkv"].reason) == "default"
    kinds = {f: x.reason.kind for f, x in s.items()}
    assert kinds["lm_head"] is ReasonKind.KEEP_HIGH_PRECISION and s["lm_head"].reason.kept_high_precision
    assert kinds["blocks.1.mlp.proj"] is ReasonKind.RULE and kinds["blocks.1.attn.qkv"] is ReasonKind.DEFAULT
    assert not s["blocks.1.mlp.proj"].reason.kept_high_precision
    assert all(isinstance(x, SitePlan) for x in sites)


def test_last_matching_rule_wins_in_either_order():
    general = {"name": "general", "select": {"glob": "blocks.*"}, "format": "fp8_tensorwise"}
    specific = {"name": "specific", "select": {"glob": "blocks.*.mlp.fc"}, "format": "nvfp4"}
    s = by_fqn(resolve(TinyGPT(), plan_of(rules=[general, specific])))
    assert s["blocks.1.mlp.fc"].format is NVFP4 and s["blocks.1.mlp.proj"].format is FP8
    # reversed, the general rule comes last and takes everything, specific included (which is allowed)
    s = by_fqn(resolve(TinyGPT(), plan_of(rules=[specific, general])))
    assert s["blocks.1.mlp.fc"].format is FP8 and str(s["blocks.1.mlp.fc"].reason) == "rule general (glob blocks.*)"


def test_default_format_and_its_ladder():
    s = by_fqn(resolve(TinyGPT(), plan_of(default="fp8_rowwise", keep_high_precision=[{"fqns": ["lm_head"]}])))
    rowwise = get_format("fp8_rowwise")
    assert s["blocks.0.attn.qkv"].format is rowwise and s["blocks.0.attn.qkv"].ladder == (rowwise, BF16)
    assert str(s["blocks.0.attn.qkv"].reason) == "default" and s["lm_head"].format is BF16


def test_site_filter_and_shape():
    model = TinyGPT()
    sites = resolve(model, PrecisionPlan(), site_filter=lambda m, f: is_linear(m) and f != "lm_head")
    assert "lm_head" not in {s.fqn for s in sites} and len(sites) == 16
    s = by_fqn(sites)
    assert s["blocks.0.mlp.fc"].shape == (128, 32) and s["blocks.0.mlp.fc"].module is model.blocks[0].mlp.fc


# --- resolve: errors that need the model ---

def test_rule_matching_nothing_suggests_nearest_fqns():
    plan = plan_of(rules=[{"name": "ok", "select": {"glob": "blocks.*"}, "format": "fp8_tensorwise"},
                          {"name": "typo", "select": {"glob": "blocks.*.mpl.*"}, "format": "nvfp4"}])
    with pytest.raises(PlanError) as e:
        resolve(TinyGPT(), plan)
    assert e.value.path == "precision.rules[1].select"
    msg = errmsg(e)
    assert "rule 'typo' (glob blocks.*.mpl.*) matches no linear layer" in msg
    assert "Nearest FQNs: blocks." in msg and ".mlp." in msg


def test_combined_selector_matching_nothing_explains_each_key():
    plan = plan_of(rules=[{"name": "r", "select": {"glob": "*.attn.*", "module_type": "MLP"}, "format": "nvfp4"}])
    with pytest.raises(PlanError) as e:
        resolve(TinyGPT(), plan)
    msg = errmsg(e)
    assert "glob *.attn.* alone matches 8; module_type MLP alone matches 8" in msg
    assert "Module types in the model:" in msg and "Attention" in msg


def test_unknown_fqn_and_module_type_get_suggestions():
    with pytest.raises(PlanError) as e:
        resolve(TinyGPT(), plan_of(keep_high_precision=[{"fqns": ["lm_heed"]}]))
    assert e.value.path == "precision.keep_high_precision[0]"
    assert "'lm_heed' is not a module. Did you mean 'lm_head'" in errmsg(e)
    with pytest.raises(PlanError) as e:
        resolve(TinyGPT(), plan_of(keep_high_precision=[{"module_type": "Embeding"}]))
    assert "Did you mean 'Embedding'" in errmsg(e)
    with pytest.raises(PlanError) as e:
        resolve(nn.Sequential(nn.Linear(16, 16)), plan_of(keep_high_precision=[{"first_layers": 1}]))
    assert "The model has no ModuleList of blocks." in errmsg(e)


def test_keep_selector_may_match_a_non_linear_module():
    keep = [{"module_type": "Embedding"}, {"module_type": "LayerNorm"}]
    s = by_fqn(resolve(TinyGPT(), plan_of(keep_high_precision=keep)))
    assert all(str(x.reason) == "default" for x in s.values())


def test_rule_matching_only_non_linear_modules_is_an_error():
    with pytest.raises(PlanError) as e:
        resolve(TinyGPT(), plan_of(rules=[{"name": "emb", "select": {"module_type": "Embedding"}, "format": "nvfp4"}]))
    assert "matches no linear layer" in errmsg(e) and e.value.path == "precision.rules[0].select"


def test_format_the_backend_cannot_run():
    def fp8_only(fmt):
        return (fmt.bits >= 8, "" if fmt.bits >= 8 else "no FP4 GEMM in torch._scaled_mm")

    plan = plan_of(backend="torch", rules=[{"name": "fp8", "select": {"glob": "*.attn.*"}, "format": "fp8_tensorwise"},
                                           {"name": "fp4", "select": {"glob": "*.mlp.*"}, "format": "nvfp4"}])
    with pytest.raises(PlanError) as e:
        resolve(TinyGPT(), plan, supported=fp8_only)
    assert e.value.path == "precision.rules[1].format"
    msg = errmsg(e)
    assert "backend 'torch' cannot run nvfp4: no FP4 GEMM in torch._scaled_mm" in msg
    assert "It runs: bf16, fp8_tensorwise" in msg and "mxfp4" not in msg.split("It runs:")[1]
    # a refused rung of the ladder points at the ladder
    plan = plan_of(rules=[{"name": "r", "select": {"glob": "*"}, "format": "fp8_tensorwise"}])
    with pytest.raises(PlanError) as e:
        resolve(TinyGPT(), plan, supported=lambda f: (f.name != "bf16", "nope"))
    assert e.value.path == "precision.rules[0].ladder"
    fp8_plan = plan_of(rules=[{"select": {"glob": "*.attn.*"}, "format": "fp8_tensorwise"}])
    assert len(resolve(TinyGPT(), fp8_plan, supported=fp8_only)) == 17


def test_shape_the_format_blocks_do_not_divide():
    model = TinyGPT(d=40)  # 40 is not a multiple of nvfp4's 16
    with pytest.raises(PlanError) as e:
        resolve(model, plan_of(rules=[{"name": "fp4", "select": {"glob": "*.mlp.fc"}, "format": "nvfp4"}]))
    msg = errmsg(e)
    assert e.value.path == "precision.rules[0].format"
    assert "layer 'blocks.0.mlp.fc' (weight 160 x 40, out x in) cannot run nvfp4" in msg
    assert "its weight (out x in) of shape (160, 40) does not fit e2m1 blocks of 16x16" in msg
    assert "40 is not a multiple of 16" in msg
    assert "add {fqns: [blocks.0.mlp.fc]} to precision.keep_high_precision" in msg and "bf16" in msg
    # 128x128 weight blocks do not fit a 32-wide model; tensorwise always fits
    with pytest.raises(PlanError, match="128x128"):
        resolve(TinyGPT(), plan_of(rules=[{"select": {"glob": "*"}, "format": "fp8_blockwise"}]))
    resolve(model, plan_of(rules=[{"select": {"glob": "*"}, "format": "fp8_tensorwise"}]))


def test_shape_check_covers_activation_and_gradient_reduction_dims():
    # out = 48 fits 1x16 (grad_output) but not 1x32 (MX); in = 64 fits both
    model = nn.Sequential(nn.Linear(64, 48))
    resolve(model, plan_of(rules=[{"select": {"glob": "0"}, "format": "nvfp4"}]))
    with pytest.raises(PlanError) as e:
        resolve(model, plan_of(rules=[{"select": {"glob": "0"}, "format": "mxfp8"}]))
    assert "layer '0' (weight 48 x 64, out x in) cannot run mxfp8" in errmsg(e)
    assert "its grad_output (tokens x out) of shape (1, 48) does not fit e4m3 blocks of 1x32" in errmsg(e)
    # in = 48 for the input: weight (64, 48) fails the weight check on its reduction dim first
    with pytest.raises(PlanError, match="weight 64 x 48, out x in"):
        resolve(nn.Sequential(nn.Linear(48, 64)), plan_of(rules=[{"select": {"glob": "0"}, "format": "mxfp4"}]))


def test_lower_ladder_rungs_are_checked_too():
    # nvfp4 fits a 32-wide model but the ladder's fp8_blockwise (128x128) does not
    plan = plan_of(rules=[{"select": {"glob": "*.mlp.*"}, "format": "nvfp4", "ladder": ["fp8_blockwise"]}])
    with pytest.raises(PlanError) as e:
        resolve(TinyGPT(), plan)
    assert e.value.path == "precision.rules[0].ladder" and "cannot run fp8_blockwise" in errmsg(e)


def test_model_without_linear_layers():
    with pytest.raises(PlanError, match="has no linear layers"):
        resolve(nn.Sequential(nn.LayerNorm(4)), PrecisionPlan())


# --- the table ---

def test_format_plan_table():
    table = format_plan_table(resolve(TinyGPT(), PrecisionPlan.from_yaml(EXAMPLE)))
    lines = table.splitlines()
    assert lines[0].split() == ["FQN", "shape", "(out", "x", "in)", "format", "ladder", "why"]
    assert set(lines[1]) <= {"-", " "} and len(lines) == 2 + 17
    row = next(line for line in lines if line.startswith("blocks.2.mlp.fc "))
    assert "128 x 32" in row and "nvfp4 -> fp8_tensorwise -> bf16" in row
    assert row.endswith("rule middle_mlp_fp4 (glob blocks.*.mlp.* and last_layers 2)")
    assert next(line for line in lines if line.startswith("lm_head")).endswith("keep_high_precision (fqns lm_head)")
    # the columns line up: every row's format starts under the header's "format"
    col = lines[0].index("format")
    assert all(line[col - 2:col] == "  " and line[col] != " " for line in lines[2:])


# --- Hugging Face models built from configs (no downloads) ---

@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=128)
    return transformers.LlamaForCausalLM(cfg)


def test_gpt2_conv1d_sites_and_transposed_shapes(gpt2):
    plan = PrecisionPlan.from_yaml(textwrap.dedent("""
        precision:
          keep_high_precision: [{module_type: Embedding}, {fqns: [lm_head]}, {first_layers: 1}]
          rules:
            - {name: attn_fp8, select: {module_type: GPT2Attention}, format: fp8_tensorwise}
            - {name: mlp_fp4, select: {glob: "transformer.h.*.mlp.*", last_layers: 1}, format: nvfp4,
               ladder: [nvfp4, fp8_tensorwise]}
        """))
    s = by_fqn(resolve(gpt2, plan))
    assert list(s) == [f"transformer.h.{i}.{n}" for i in range(2)
                       for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] + ["lm_head"]
    # Conv1D stores (in, out); shapes are reported (out, in)
    assert gpt2.transformer.h[1].attn.c_attn.weight.shape == (64, 192)
    assert s["transformer.h.1.attn.c_attn"].shape == (192, 64)
    assert linear_shape(gpt2.transformer.h[1].mlp.c_proj) == (64, 256)
    assert s["transformer.h.1.mlp.c_fc"].shape == (256, 64)
    assert str(s["transformer.h.0.mlp.c_fc"].reason) == "keep_high_precision (first_layers 1)"
    assert str(s["transformer.h.1.attn.c_attn"].reason) == "rule attn_fp8 (module_type GPT2Attention)"
    assert s["transformer.h.1.mlp.c_fc"].ladder == (NVFP4, FP8, BF16)
    assert s["lm_head"].format is BF16
    table = format_plan_table(list(s.values())).splitlines()
    row = next(r for r in table if r.startswith("transformer.h.1.mlp.c_proj"))
    assert row.split()[1:4] == ["64", "x", "256"]


def test_gpt2_shape_error_uses_out_x_in(gpt2):
    # c_attn is 192 x 64 (out x in): 128x128 weight blocks divide neither
    with pytest.raises(PlanError) as e:
        resolve(gpt2, plan_of(rules=[{"select": {"glob": "*.attn.c_attn"}, "format": "fp8_blockwise"}]))
    assert "layer 'transformer.h.0.attn.c_attn' (weight 192 x 64, out x in)" in errmsg(e)


def test_llama_selectors(llama):
    plan = plan_of(keep_high_precision=[{"fqns": ["lm_head"]}, {"last_layers": 1}],
                   rules=[{"name": "fp8", "select": {"regex": r"model\.layers\.\d+\..*"}, "format": "fp8_tensorwise"},
                          {"name": "attn_fp4", "select": {"module_type": "LlamaAttention", "first_layers": 1},
                           "format": "nvfp4"}])
    s = by_fqn(resolve(llama, plan))
    assert len(s) == 3 * 7 + 1
    k_proj = s["model.layers.0.self_attn.k_proj"]
    assert k_proj.format is NVFP4 and k_proj.shape == (32, 64)
    assert s["model.layers.0.mlp.up_proj"].format is FP8
    assert str(s["model.layers.1.self_attn.q_proj"].reason) == "rule fp8 (regex model\\.layers\\.\\d+\\..*)"
    assert str(s["model.layers.2.mlp.down_proj"].reason) == "keep_high_precision (last_layers 1)"
    assert ModelInfo.of(llama).block("model.layers.2.mlp.down_proj") == (2, 3)


def test_llama_typo_suggests_real_fqns(llama):
    with pytest.raises(PlanError) as e:
        resolve(llama, plan_of(rules=[{"name": "up", "select": {"glob": "model.layers.*.mlp.up_prj"},
                                       "format": "nvfp4"}]))
    assert "Nearest FQNs: model.layers." in errmsg(e) and "up_proj" in errmsg(e)


PLAN_MODEL = '''
import torch
from torch import nn


def build():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def tokens():
    return torch.arange(1000) % 7
'''


def test_lowprec_plan_needs_only_the_config_and_the_model(tmp_path, monkeypatch, capsys):
    """`lowprec plan` prints the plan and the stages, then lists the runtime inputs still missing
    (the loss-gap baseline run, a losses file), exit 0; `run` fails on the same config (exit 2)."""
    from lowprec.cli import main
    (tmp_path / "planmodel.py").write_text(PLAN_MODEL)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(textwrap.dedent(f"""
        model: {{factory: "planmodel:build"}}
        data: {{factory: "planmodel:tokens", block_size: 4}}
        train: {{steps: 2, batch_size: 2}}
        precision: {{default: bf16, rules: [{{select: {{glob: "*"}}, format: bf16, ladder: [fp8_tensorwise, bf16]}}]}}
        rollout:
          thresholds: {{loss_gap: 0.03}}
          baseline: {{mlflow_run: bf16-baseline}}
          stages: [{{name: all_fp8, select: {{glob: "*"}}, format: fp8_tensorwise}}]
        tracking: {{uri: "sqlite:///{tmp_path}/mlflow.db"}}
        """))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(cfg)]) == 0
    out = capsys.readouterr().out
    table, _, rest = out.partition("rollout stages:")
    assert "0 " in table and "fp8_tensorwise -> bf16" in table and "all_fp8: 2 sites -> fp8_tensorwise" in rest
    assert "still missing before `lowprec run` (1;" in rest
    assert f"rollout.baseline.mlflow_run: no run 'bf16-baseline': there is no tracking store at {tmp_path}" in rest
    assert not (tmp_path / "mlflow.db").exists()
    assert main(["run", str(cfg), "--out", str(tmp_path / "out")]) == 2
    assert "no run 'bf16-baseline'" in capsys.readouterr().err

    cfg.write_text(cfg.read_text().replace("{mlflow_run: bf16-baseline}", "{losses: absent.json}"))
    assert main(["plan", str(cfg)]) == 0
    assert "rollout.baseline.losses: 'absent.json' not found" in capsys.readouterr().out


def test_amax_scope_parsed_validated_and_round_tripped():
    from lowprec.sites.amax_scope import AmaxScope
    assert PrecisionPlan.from_dict({}).amax_scope is AmaxScope.LOCAL   # torchao's behaviour by default
    plan = PrecisionPlan.from_dict({"amax_scope": "local"})
    assert plan.amax_scope is AmaxScope.LOCAL
    assert PrecisionPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(PlanError, match=r"amax_scope: expected one of 'local', 'group', found the string 'lcoal'\. Did you mean 'local'"):
        PrecisionPlan.from_dict({"amax_scope": "lcoal"})
