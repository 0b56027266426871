"""Structured outputs through the server with the real clients, on SmolLM2: the openai
client's `chat.completions.parse(response_format=PydanticModel)` (OpenAI's json_schema,
strict) streamed and not, `response_format: json_object`, and vLLM's `structured_outputs`
regex and choice on a seeded sampled batch (n=4, temperature 1.0). Every output is
checked by the schema (pydantic validation), the regex or the choice list; the invalid
ones are 400s in tests/entrypoints/test_server_errors.py."""

import concurrent.futures
import json
import re

import pydantic
import pytest

from tests.helpers.server_harness import MODEL


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population_millions: int = pydantic.Field(ge=0, le=100)
    coastal: bool


CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Sydney", "Toronto", "Mumbai", "Berlin"]
PROMPTS = [f"Describe the city of {c} as JSON." for c in CITIES] + \
          [f"Give facts about {c} in JSON: name, country, population in millions, coastal." for c in CITIES]


@pytest.mark.parametrize("stream", [False, True])
def test_parse_with_a_pydantic_model_returns_objects_that_validate(live_server, stream):
    client = live_server.openai()

    def ask(prompt):
        messages = [{"role": "user", "content": prompt}]
        if stream:
            with client.chat.completions.stream(model=MODEL, messages=messages, response_format=City,
                                                max_tokens=96, temperature=0) as s:
                return s.get_final_completion()
        return client.chat.completions.parse(model=MODEL, messages=messages, response_format=City, max_tokens=96,
                                             temperature=0)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # 20 at once: they batch in the engine
        completions = list(pool.map(ask, PROMPTS))
    parsed = []
    for completion in completions:
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, City)  # the client validated it against the model
        City.model_validate_json(message.content)
        parsed.append(message.parsed)
    assert len({p.name for p in parsed}) > 5  # not one constant answer
    live_server.assert_all_blocks_free()


def test_json_object_mode(live_server):
    r = live_server.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 256, "temperature": 0, "response_format": {"type": "json_object"},
        "messages": [{"role": "user", "content": "Give me a short JSON object with a cat's name and age."}]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice_hold_on_a_seeded_sampled_batch(live_server, stream):
    regex = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}( years old)?\."
    choices = ["yes", "no", "maybe"]
    cases = [({"regex": regex}, lambda t: re.fullmatch(regex, t) is not None, "Tell me about someone's age."),
             ({"choice": choices}, lambda t: t in choices, "Is the sky green?")]
    for constraint, holds, prompt in cases:
        body = {"model": MODEL, "prompt": prompt, "n": 4, "temperature": 1.0, "seed": 7, "max_tokens": 40,
                "structured_outputs": constraint}
        if stream:
            r = live_server.post("/v1/completions", json={**body, "stream": True})
            assert r.status_code == 200, r.text
            texts, finish = ["" for _ in range(4)], [None] * 4
            for line in r.text.splitlines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        texts[c["index"]] += c["text"]
                        finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
        else:
            r = live_server.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choices_out = sorted(r.json()["choices"], key=lambda c: c["index"])
            texts, finish = [c["text"] for c in choices_out], [c["finish_reason"] for c in choices_out]
        assert finish == ["stop"] * 4, (constraint, texts)
        assert all(holds(t) for t in texts), (constraint, texts)
    live_server.assert_all_blocks_free()
