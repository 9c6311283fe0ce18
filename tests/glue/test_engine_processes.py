"""The plugin inside vLLM's real processes: a user's ``LLM(...)`` with a specx method.

vLLM's default mode runs the engine core (and, with one worker, the worker) in a
separate process that imports nothing from the user's script. Everything specx does
there must come from the entry point alone. One engine, started in a fresh interpreter
exactly as a user script would, is probed from inside its worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_specx.fixtures import fixture_model_dirs

PROMPTS = ["def parse_args(argv):\n", "class Queue:\n    def __init__(self", "import os\n"]
MAX_TOKENS = 24

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from vllm import LLM, SamplingParams

    def probe(worker):
        import vllm_specx.plugin as plugin
        runner = worker.model_runner
        return {
            "pid": os.getpid(),
            "registered": plugin._registered,
            "runner_patch": getattr(type(runner).__mro__[1].__init__, "__specx_patch__", None)
            if type(runner).__name__ == "CPUModelRunner"
            else getattr(type(runner).__init__, "__specx_patch__", None),
            "drafter": type(runner.drafter).__name__,
            "sampler": type(runner.rejection_sampler).__name__,
            "rule": runner.rejection_sampler.rule,
            "specx": runner.vllm_config.additional_config.get("specx"),
        }

    if __name__ == "__main__":
        target, draft = sys.argv[1], sys.argv[2]
        prompts, max_tokens = json.loads(sys.argv[3]), int(sys.argv[4])
        llm = LLM(model=target, dtype="float32", enforce_eager=True, block_size=32,
                  kv_cache_memory_bytes=64 << 20, max_model_len=256, seed=0,
                  disable_log_stats=False,
                  speculative_config={"method": "mtad", "model": draft,
                                      "num_speculative_tokens": 3, "num_beams": 2,
                                      "cost_control": False})
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                    ignore_eos=True), use_tqdm=False)
        metrics = {m.name: m.value for m in llm.get_metrics()
                   if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}
        print("RESULT " + json.dumps({
            "script_pid": os.getpid(),
            "probe": llm.collective_rpc(probe),
            "outputs": [[list(o.prompt_token_ids), list(o.outputs[0].token_ids)] for o in outs],
            "metrics": metrics,
        }))
    """
)


@pytest.fixture(scope="module")
def mtad_run(tmp_path_factory):
    target, draft = fixture_model_dirs()
    script = tmp_path_factory.mktemp("user") / "user_script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    # collective_rpc with a function from the script (the probe) needs pickle transport.
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    out = subprocess.run(
        [sys.executable, str(script), str(target), str(draft), json.dumps(PROMPTS),
         str(MAX_TOKENS)],
        capture_output=True, text=True, timeout=600, env=env, cwd=script.parent,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), str(target)


@pytest.mark.engine
def test_plugin_is_active_in_the_engine_process_without_user_import(mtad_run):
    result, _ = mtad_run
    (probe,) = result["probe"]
    assert probe["pid"] != result["script_pid"]  # really another process
    assert probe["registered"] is True
    assert probe["runner_patch"] == "runner_specx_components"
    assert probe["drafter"] == "MTADProposer"
    assert probe["sampler"] == "SpecxRejectionSampler"
    assert probe["rule"] == "mtad"
    assert probe["specx"] == {"method": "mtad", "num_speculative_tokens": 3, "num_beams": 2,
                              "acceptance_threshold": 0.1, "greedy_drafting": "chain",
                              "draft_tree": False, "cost_control": False}


@pytest.mark.engine
def test_greedy_mtad_equals_non_speculative_greedy(mtad_run):
    from vllm_specx.testing.hf_reference import hf_greedy

    result, target = mtad_run
    prompts = [p for p, _ in result["outputs"]]
    reference = hf_greedy(target, prompts, MAX_TOKENS)
    for (_, generated), ref in zip(result["outputs"], reference):
        assert generated == ref.token_ids


@pytest.mark.engine
def test_vllm_spec_decode_metrics_report_mtad_acceptance(mtad_run):
    result, _ = mtad_run
    metrics = result["metrics"]
    drafts = metrics["vllm:spec_decode_num_drafts"]
    drafted = metrics["vllm:spec_decode_num_draft_tokens"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    generated = len(PROMPTS) * MAX_TOKENS
    assert drafts > 0 and drafted == 3 * drafts  # MTAD drafts K tokens (cost_control off)
    assert 0 < accepted < drafted  # the trained pair agrees often, not always
    # Each request gets one token from its prefill, then accepted drafts + 1 per verify
    # step; its last step may overshoot max_tokens by up to K tokens, which vLLM trims.
    trimmed = len(PROMPTS) + accepted + drafts - generated
    assert 0 <= trimmed <= 3 * len(PROMPTS)
