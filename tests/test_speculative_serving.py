"""Speculative decoding through the whole serving path (Ray Serve ingress, scheduler actor with async scheduling,
model worker) over real HTTP with the `openai` SDK: streams whose steps carry several tokens have the text of the
engine without drafts, stop strings cut inside a step's tokens, the drafts show in /metrics, nothing lingers."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from openai import OpenAI

from configs.app_config import AppConfig
from configs.sampling_params import SamplingParams
from tests.helpers import assert_engine_drained

pytestmark = pytest.mark.serve

MODEL = "tiny-speculative"
PREFIX = "/speculative"
CONFIG = AppConfig.model_validate(
    {
        "model": {"name": "tiny-random-llama", "served_model_name": MODEL},
        "cache": {"num_kv_blocks": 128},
        "scheduler": {
            "max_num_seqs": 8,
            "speculative_config": {"num_speculative_tokens": 3, "disable_by_batch_size": None},
        },
        "parallel": {"worker_num_cpus": 0.5, "num_threads": 1},
        "serve": {"app_name": "speculative", "route_prefix": PREFIX, "ingress_num_cpus": 0.1},
    }
)
PROMPTS = ["The quick brown fox", "one two one two one two", "Hello"]
# Three tokens that win every step between them: the model's picks among them loop, and drafts are accepted.
BIAS = {"77": 100.0, "78": 100.0, "79": 100.0}


@pytest.fixture(scope="module")
def root(deploy_module_app) -> str:
    return deploy_module_app(CONFIG)


@pytest.fixture(scope="module")
def client(root: str) -> OpenAI:
    return OpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain_texts(tiny_model_dir) -> dict[tuple[str, bool], str]:
    """The tiny model's greedy text of each prompt, with and without the bias, from an engine without drafts."""
    from executor import LLM

    llm = LLM(model=str(tiny_model_dir), show_progress=False, num_kv_blocks=128)
    texts = {}
    for biased in (False, True):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=20,
            ignore_eos=True,
            logit_bias={int(token): bias for token, bias in BIAS.items()} if biased else None,
        )
        for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False), strict=True):
            texts[(prompt, biased)] = output.outputs[0].text
    return texts


def streamed_text(client: OpenAI, prompt: str, biased: bool, **kwargs) -> tuple[str, list]:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=kwargs.pop("max_tokens", 20),
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            logit_bias=BIAS if biased else None,
            extra_body={"ignore_eos": True},
            **kwargs,
        )
    )
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices), chunks


def test_concurrent_streams_with_drafts_have_the_text_of_one_token_steps(client: OpenAI, plain_texts, root: str):
    jobs = [(prompt, biased) for prompt in PROMPTS for biased in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: streamed_text(client, *job), jobs))
    for job, (text, chunks) in zip(jobs, results, strict=True):
        assert text == plain_texts[job], job
        assert chunks[-1].usage.completion_tokens == 20
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
    metrics = httpx.get(f"{root}/metrics", timeout=30).text
    accepted = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("pagedserve:spec_decode_num_accepted_tokens_total{") and f'model_name="{MODEL}"' in line
    ]
    assert accepted and accepted[0] > 15  # the biased streams: 26 of their 60 tokens came as accepted drafts


def test_a_stop_string_inside_a_steps_tokens_ends_the_stream_there(client: OpenAI, plain_texts):
    text = plain_texts[("one two one two one two", True)]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    streamed, chunks = streamed_text(client, "one two one two one two", True, stop=[stop])
    assert streamed == text[: text.index(stop)]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]


def test_nothing_lingers_after_streams_with_drafts(client: OpenAI):
    for max_tokens in (5, 6, 7):
        streamed_text(client, "one two one two", True, max_tokens=max_tokens)
    assert_engine_drained(CONFIG.serve.app_name)
