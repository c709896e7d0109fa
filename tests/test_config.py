"""Unit tests of the MAGICPIG config parser and validators (no vLLM, no model; fast).

Every rejected config must raise MagicPigConfigError whose message names the bad key
and says what is allowed: these messages are what a user sees when `vllm serve` refuses
to start.
"""
from __future__ import annotations

import re

import pytest

from vllm_magicpig.config import (
    MagicPigConfig,
    MagicPigConfigError,
    centerings,
    decode_method_names,
    parse_config,
    validate_for_model,
)
from vllm_magicpig.eval.decode import settings as eval_settings

from helpers import make_runtime

CENTERINGS = centerings()
DECODE_METHODS = decode_method_names()  # production's and the evaluation extension's


def _parse(**magicpig):
    return parse_config({"magicpig": magicpig})


def _raises(match_all: list[str], **magicpig) -> str:
    """parse_config must raise MagicPigConfigError whose message contains every string."""
    with pytest.raises(MagicPigConfigError) as ei:
        _parse(**magicpig)
    msg = str(ei.value)
    for s in match_all:
        assert s in msg, f"{s!r} not in error message {msg!r}"
    return msg


# --------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("additional_config", [None, {}, {"magicpig": {}}, {"magicpig": None},
                                               {"other_plugin": {"x": 1}}])
def test_defaults_are_the_papers(additional_config):
    cfg = parse_config(additional_config)
    assert isinstance(cfg, MagicPigConfig)
    assert (cfg.K, cfg.L) == (10, 150)
    assert cfg.sink_tokens == 4
    assert cfg.local_window == 64
    assert cfg.dense_layers is None
    assert cfg.centering == "request"
    assert cfg.decode_method == "magicpig"
    assert cfg == MagicPigConfig()


def test_valid_values_are_kept():
    cfg = _parse(K=16, L=2, sink_tokens=0, local_window=0, min_sparse_context=0,
                 dense_layers=[5, 1, 5], centering="none", decode_method="exact",
                 segment_tokens=256, max_segment_tokens=256, inherit_centre=False,
                 budget_fraction=1, log_stats_interval=0)
    assert (cfg.K, cfg.L, cfg.sink_tokens, cfg.local_window, cfg.min_sparse_context) == (16, 2, 0, 0, 0)
    assert cfg.dense_layers == (1, 5)  # sorted, deduplicated
    assert cfg.centering == "none" and cfg.decode_method == "exact"
    assert (cfg.segment_tokens, cfg.max_segment_tokens) == (256, 256)
    assert cfg.inherit_centre is False
    assert cfg.option("budget_fraction") == 1.0 and isinstance(cfg.option("budget_fraction"), float)
    assert cfg.log_stats_interval == 0


@pytest.mark.parametrize("k", [1, 16])
def test_K_range_bounds_are_inclusive(k):
    assert _parse(K=k).K == k


@pytest.mark.parametrize("l", [2, 1024])
def test_L_range_bounds_are_inclusive(l):
    assert _parse(L=l).L == l


# --------------------------------------------------------------------------- bad keys / types


def test_unknown_key_lists_allowed_keys():
    msg = _raises(["'KK'", "allowed keys"], KK=3)
    allowed = msg.split("allowed keys:", 1)[1]
    for key in ("K", "L", "sink_tokens", "local_window", "dense_layers", "min_sparse_context",
                "segment_tokens", "max_segment_tokens", "centering", "decode_method"):
        assert re.search(rf"\b{key}\b", allowed), f"allowed-keys list lacks {key}: {msg}"


def test_not_a_mapping():
    with pytest.raises(MagicPigConfigError, match=r'additional_config\["magicpig"\].*JSON object'):
        parse_config({"magicpig": [10, 150]})


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("K", "10", ["'K'", "must be an integer", "'10'", "str"]),
        ("K", True, ["'K'", "must be an integer", "bool"]),
        ("L", 150.0, ["'L'", "must be an integer", "float"]),
        ("sink_tokens", None, ["'sink_tokens'", "must be an integer"]),
        ("local_window", "64", ["'local_window'", "must be an integer"]),
    ],
)
def test_wrong_type(key, value, expected):
    _raises(expected, **{key: value})


@pytest.mark.parametrize("value", [3, "0,15", {"0": True}])
def test_dense_layers_not_a_list(value):
    _raises(["'dense_layers'", "must be a list of layer indices"], dense_layers=value)


@pytest.mark.parametrize("entry", [-1, "3", True, 1.0])
def test_dense_layers_bad_entry(entry):
    _raises(["'dense_layers'", "non-negative integers", repr(entry)], dense_layers=[0, entry])


def test_inherit_centre_must_be_bool():
    _raises(["'inherit_centre'", "true or false"], inherit_centre=1)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, "0.1"])
def test_budget_fraction_out_of_range(value):
    _raises(["'budget_fraction'", "(0, 1]"], budget_fraction=value)


# --------------------------------------------------------------------------- ranges


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("K", 0, "1..16"),
        ("K", 17, "1..16"),
        ("K", -3, "1..16"),
        ("L", 1, "2..1024"),
        ("L", 1025, "2..1024"),
        ("sink_tokens", -1, ">= 0"),
        ("local_window", -64, ">= 0"),
        ("min_sparse_context", -1, ">= 0"),
        ("segment_tokens", 8, "16..32768"),
        ("max_segment_tokens", 65536, "16..32768"),
        ("index_memory_mb", 0, ">= 1"),
        ("node_reserve_mb", -1, ">= 0"),
        ("log_stats_interval", -1, ">= 0"),
    ],
)
def test_out_of_range_names_key_and_range(key, value, allowed):
    _raises([f"'{key}'={value}", "out of range", f"allowed: {allowed}"], **{key: value})


@pytest.mark.parametrize("key,allowed", [("centering", CENTERINGS), ("decode_method", DECODE_METHODS),
                                         ("mirror_dtype", ("auto", "int8"))])
def test_bad_choice_lists_allowed_values(key, allowed):
    msg = _raises([f"'{key}'='bogus'", "not supported", "allowed:"], **{key: "bogus"})
    for v in allowed:
        assert v in msg.split("allowed:", 1)[1], msg


def test_choice_sets_contain_the_defaults():
    assert "request" in CENTERINGS and "none" in CENTERINGS  # the paper's centring, and the ablation
    assert "magicpig" in DECODE_METHODS and "exact" in DECODE_METHODS
    for v in CENTERINGS:
        assert _parse(centering=v).centering == v
    for v in DECODE_METHODS:
        assert _parse(decode_method=v).decode_method == v
    assert MagicPigConfig().mirror_dtype == "auto" and _parse(mirror_dtype="int8").mirror_dtype == "int8"


def test_max_segment_smaller_than_segment():
    _raises(["'max_segment_tokens'=512", "'segment_tokens'=1024", ">="],
            segment_tokens=1024, max_segment_tokens=512)
    _raises(["'max_segment_tokens'=1024", "'segment_tokens'=2048"],
            segment_tokens=2048, max_segment_tokens=1024)


def test_error_is_a_value_error():
    # vLLM front ends report ValueErrors as config errors; keep it one.
    assert issubclass(MagicPigConfigError, ValueError)


# --------------------------------------------------------------------------- model-dependent checks


def test_dense_layers_outside_model():
    cfg = _parse(dense_layers=[0, 30])
    with pytest.raises(MagicPigConfigError) as ei:
        validate_for_model(cfg, num_layers=30, block_size=128)
    msg = str(ei.value)
    assert "'dense_layers'" in msg and "[30]" in msg and "allowed: 0..29" in msg, msg
    validate_for_model(_parse(dense_layers=[0, 29]), num_layers=30, block_size=128)  # last layer is fine


def test_dense_layers_default_is_first_and_middle():
    cfg = MagicPigConfig()
    assert cfg.resolved_dense_layers(30) == frozenset({0, 15})
    assert cfg.resolved_dense_layers(32) == frozenset({0, 16})  # the paper's 0 and 16 of 32
    assert cfg.resolved_dense_layers(1) == frozenset({0})
    assert _parse(dense_layers=[]).resolved_dense_layers(30) == frozenset()
    assert _parse(dense_layers=[3, 7]).resolved_dense_layers(30) == frozenset({3, 7})


@pytest.mark.parametrize("key,value", [("segment_tokens", 1000), ("max_segment_tokens", 30000)])
def test_segment_sizes_must_be_block_multiples(key, value):
    cfg = _parse(**{key: value})
    with pytest.raises(MagicPigConfigError) as ei:
        validate_for_model(cfg, num_layers=30, block_size=128)
    msg = str(ei.value)
    assert f"'{key}'={value}" in msg and "multiple of the KV block size (128)" in msg, msg


def test_validate_for_model_accepts_defaults():
    validate_for_model(MagicPigConfig(), num_layers=30, block_size=128)
    validate_for_model(MagicPigConfig(), num_layers=30, block_size=None)
    validate_for_model(MagicPigConfig(), num_layers=30, block_size=32)


# --------------------------------------------------------------------------- evaluation override


@pytest.fixture
def rt():
    return make_runtime()


def _effective_method(rt) -> str:
    """The decode method a step would use under the default config."""
    return rt.step_settings().method


def test_set_decode_method(rt):
    assert _effective_method(rt) == "magicpig"
    for m in DECODE_METHODS:
        eval_settings.set_decode_method(rt, m)
        assert _effective_method(rt) == m
    eval_settings.set_decode_method(rt, None)
    assert _effective_method(rt) == "magicpig"  # back to the configured method
    assert make_runtime(MagicPigConfig(decode_method="exact")).step_settings().method == "exact"


def test_eval_settings_hook_attached_only_while_an_override_is_set(rt):
    """Evaluation code stays out of production steps: the override's settings hook is attached to
    the runtime when an override is set and taken off when it is cleared."""
    assert rt.settings_hooks == [] and rt.step_settings().K == rt.cfg.K
    eval_settings.set_eval(rt, K=8)
    assert rt.settings_hooks == [eval_settings.apply_override] and rt.step_settings().K == 8
    eval_settings.set_eval(rt, K=9, measure_error=True)  # a second override replaces the first, once
    assert rt.settings_hooks == [eval_settings.apply_override] and rt.step_settings().K == 9
    eval_settings.set_eval(rt)
    assert rt.settings_hooks == [] and rt.step_settings().K == rt.cfg.K
    assert make_runtime().settings_hooks == []  # another runtime never saw this one's hook


@pytest.mark.parametrize("bad", ["bogus", "MAGICPIG", "", "dense"])
def test_set_decode_method_rejects_unknown(rt, bad):
    eval_settings.set_decode_method(rt, "exact")
    with pytest.raises(ValueError) as ei:
        eval_settings.set_decode_method(rt, bad)
    msg = str(ei.value)
    assert repr(bad) in msg and all(m in msg for m in DECODE_METHODS), msg
    assert _effective_method(rt) == "exact"  # a rejected call changes nothing


def test_centring_is_an_alias_of_centering():
    assert _parse(centring="none").centering == "none"
    assert _parse(centering="none") == _parse(centring="none")
    _raises(["'centring'", "'centering'", "not both"], centring="none", centering="request")
    _raises(["'centering'='sideways'", "allowed: request, none"], centring="sideways")


def test_extension_keys_keep_their_defaults_and_checks():
    cfg = _parse(quest_page_size=8)
    assert cfg.option("quest_page_size") == 8 and cfg.option("budget_fraction") == 0.04
    assert cfg.as_dict()["quest_page_size"] == 8  # spelled as the user spells it
    _raises(["'quest_page_size'=0", "allowed: 1..4096"], quest_page_size=0)


# --------------------------------------------------------------------------- budget mode


def test_target_cost_is_kept_and_K_L_stay_defaults():
    cfg = _parse(target_cost=0.02)
    assert cfg.target_cost == 0.02 and isinstance(cfg.target_cost, float)
    assert (cfg.max_L, cfg.calibration_decodes) == (300, 8)
    assert _parse(target_cost=0.04, max_L=120, calibration_decodes=3).max_L == 120
    assert _parse().target_cost is None and _parse(target_cost=None).target_cost is None


@pytest.mark.parametrize("explicit", [{"K": 10}, {"L": 150}, {"K": 9, "L": 120}])
def test_target_cost_with_explicit_K_or_L_is_refused(explicit):
    keys = [repr(k) for k in explicit]
    msg = _raises(["'target_cost'", "cannot be combined with", *keys, "drop"], target_cost=0.02, **explicit)
    assert "drop 'target_cost'" in msg


@pytest.mark.parametrize("value", [0, 0.0005, 0.51, 1, -0.02])
def test_target_cost_out_of_range(value):
    _raises(["'target_cost'", "out of range", "0.001..0.5"], target_cost=value)


@pytest.mark.parametrize("value", ["0.02", True, [0.02]])
def test_target_cost_wrong_type(value):
    _raises(["'target_cost'", "must be a number"], target_cost=value)


@pytest.mark.parametrize("key,value", [("max_L", 100), ("calibration_decodes", 4)])
def test_budget_keys_need_a_target(key, value):
    _raises([repr(key), "only in budget mode", "add 'target_cost'"], **{key: value})


@pytest.mark.parametrize("key,value,allowed", [("max_L", 1, "2..1024"), ("calibration_decodes", 0, "1..")])
def test_budget_key_ranges(key, value, allowed):
    _raises([repr(key), allowed], target_cost=0.02, **{key: value})


def test_the_removed_budget_feedback_key_is_unknown():
    _raises(["'budget_feedback'"], target_cost=0.02, budget_feedback=True)


def test_target_cost_needs_the_magicpig_method():
    _raises(["'target_cost'", "decode_method 'magicpig'", "'exact'"], target_cost=0.02, decode_method="exact")


def test_eval_override_target_cost_excludes_K_L():
    rt = make_runtime()
    with pytest.raises(ValueError, match="target_cost"):
        eval_settings.set_eval(rt, target_cost=0.02, K=10)
    with pytest.raises(ValueError, match="target_cost"):
        eval_settings.set_eval(rt, target_cost=0.9)
    eval_settings.set_eval(rt, target_cost=0.04)
    assert rt.step_settings().target_cost == 0.04
    eval_settings.set_eval(rt, K=9, L=120)
    assert rt.step_settings().target_cost is None and rt.step_settings().K == 9


def test_eval_override_budget_max_L():
    """The harness's budget rows with a larger L: max_L only with target_cost, in range; the runtime's
    budget takes it and forgets the choices made under the old one, and goes back to the config's."""
    rt = make_runtime()
    with pytest.raises(ValueError, match="'max_L' applies only in budget mode"):
        eval_settings.set_eval(rt, max_L=200)
    with pytest.raises(ValueError, match="max_L"):
        eval_settings.set_eval(rt, target_cost=0.02, max_L=1)
    rt.budget._requests["stale"] = object()  # a choice made under the config's max_L
    eval_settings.set_eval(rt, target_cost=0.02, max_L=200)
    assert rt.budget.max_L == 200 and not rt.budget._requests
    rt.budget._requests["kept"] = object()
    eval_settings.set_eval(rt, target_cost=0.04, max_L=200)  # same max_L: choices kept
    assert "kept" in rt.budget._requests
    eval_settings.set_eval(rt)
    assert rt.budget.max_L == rt.cfg.max_L and not rt.budget._requests
