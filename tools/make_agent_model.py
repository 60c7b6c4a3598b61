"""Make a tiny checkpoint that acts as an agent model: it reasons in `<think>…</think>`
and calls tools in the Hermes / Qwen format (`<tool_call>{"name", "arguments"}</tool_call>`)
on its own, so the gateway's tool-call and reasoning parsers are tested on real
generations rather than canned text.

The chat template is Hermes-style over the demo tokenizer's role tokens: the tools'
signatures in the system turn inside `<tools>`, tool results as `<tool_response>`
turns, and a generation prompt that opens `<think>` (the `deepseek_r1` reasoning
convention). The model is trained from scratch on a synthetic corpus of three kinds of
conversation: a weather or time question with the tools offered (it thinks, then calls
`get_weather(city)` or `get_time(timezone)`), the same after the tool answered (it
thinks, then answers from the result), and small talk (it thinks, then answers). About
a minute on 2 CPU cores.

    python -m tools.make_agent_model .cache/models/agent-tiny
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tools.make_model import fit

CITIES = ["Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Madrid", "Seoul", "Quito", "Dakar", "Sydney", "Rome",
          "Lagos", "Denver", "Hanoi", "Porto"]
ZONES = ["Europe/Paris", "Asia/Tokyo", "America/Lima", "Africa/Cairo", "Europe/Oslo", "Asia/Seoul"]
SKIES = ["sunny", "cloudy", "rainy", "windy", "snowy"]
SYSTEMS = ["You are a helpful assistant.", "You are a weather agent. Use the tools.", "Answer briefly.",
           "You help people plan their day.", "You are an assistant with tools."]
SYSTEM_WORDS = ["you", "are", "an", "agent", "assistant", "bot", "that", "helps", "users", "answer", "questions", "use",
                "tools", "when", "needed", "be", "brief"]
WEATHER_ASKS = ["What is the weather in {c}?", "How is the weather in {c} today?", "Weather in {c}, please.",
                "Is it warm in {c}?", "Tell me the weather for {c}."]
TIME_ASKS = ["What time is it in {z}?", "Current time in {z}?", "Tell me the time in {z}."]
SMALL_TALK = [("Hello!", "Hello! How can I help you today?"), ("Thanks.", "You are welcome."),
              ("Who are you?", "I am a small assistant that can look up the weather and the time."),
              ("Say something nice.", "Have a wonderful day."), ("Goodbye.", "Goodbye, take care.")]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone.",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}

CHAT_TEMPLATE = """\
{%- if messages and messages[0]['role'] == 'system' -%}{%- set system = messages[0]['content'] -%}
{%- else -%}{%- set system = 'You are a helpful assistant.' -%}{%- endif -%}
<|system|>{{ system }}
{%- if tools %}

# Tools
You may call functions. Their signatures are inside <tools></tools>:
<tools>
{%- for t in tools %}
{{ (t['function'] if t['function'] is defined else t) | tojson }}
{%- endfor %}
</tools>
For each call, write <tool_call>{"name": <name>, "arguments": <arguments object>}</tool_call>.
{%- endif %}<|end|>
{%- for m in messages %}
{%- if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>
{%- elif m['role'] == 'assistant' %}<|assistant|><think>
</think>

{{ m['content'] or '' }}
{%- for c in (m['tool_calls'] or []) %}<tool_call>
{"name": {{ c['function']['name'] | tojson }}, "arguments": {{ c['function']['arguments'] | tojson }}}
</tool_call>
{%- endfor %}<|end|>
{%- elif m['role'] == 'tool' %}<|user|><tool_response>
{{ m['content'] }}
</tool_response><|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|><think>
{% endif %}"""


def _variant(tool: dict, rng: random.Random) -> dict:
    """The tool as different clients spell it: pydantic's titles, a closed object, another
    description (the Agents SDK's schemas look like the second)."""
    fn = json.loads(json.dumps(tool["function"]))
    if rng.random() < 0.5:
        params = fn["parameters"]
        for name, prop in params["properties"].items():
            prop["title"] = name.title()
        params.update(title=f"{fn['name']}_args", additionalProperties=False)
    if rng.random() < 0.3:
        fn["description"] = rng.choice(["Look it up.", "A tool.", f"Calls {fn['name']}."])
    return {"type": "function", "function": fn}


def _system(rng: random.Random) -> list[dict]:
    if rng.random() < 0.2:
        return []
    if rng.random() < 0.5:
        return [{"role": "system", "content": rng.choice(SYSTEMS)}]
    return [{"role": "system", "content": " ".join(rng.choice(SYSTEM_WORDS) for _ in range(rng.randint(3, 12))).capitalize()
             + "."}]


def _call(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def conversation(rng: random.Random) -> tuple[list[dict], list[dict] | None, str]:
    """(messages, tools, the assistant's answer after its generation prompt)."""
    system = _system(rng)
    tools = [WEATHER_TOOL, TIME_TOOL] if rng.random() < 0.5 else rng.choice([[WEATHER_TOOL], [TIME_TOOL]])
    tools = [_variant(t, rng) for t in tools]
    kind = rng.random()
    if kind < 0.4:  # a question a tool answers: think, call
        if any(t["function"]["name"] == "get_weather" for t in tools) and (len(tools) == 1 or rng.random() < 0.5):
            city = rng.choice(CITIES)
            ask = rng.choice(WEATHER_ASKS).format(c=city)
            answer = (f"The user asks about the weather in {city}. I will call get_weather.\n</think>\n\n"
                      + _call("get_weather", {"city": city}))
        else:
            zone = rng.choice(ZONES)
            ask = rng.choice(TIME_ASKS).format(z=zone)
            answer = (f"The user asks for the time in {zone}. I will call get_time.\n</think>\n\n"
                      + _call("get_time", {"timezone": zone}))
        return system + [{"role": "user", "content": ask}], tools, answer
    if kind < 0.8:  # the tool answered: think, answer from its result
        city, sky, temp = rng.choice(CITIES), rng.choice(SKIES), rng.randint(-5, 35)
        call = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": city}}}
        result = json.dumps({"city": city, "sky": sky, "temperature_c": temp})
        messages = system + [{"role": "user", "content": rng.choice(WEATHER_ASKS).format(c=city)},
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1", "content": result}]
        answer = (f"The tool says it is {sky} in {city}.\n</think>\n\n"
                  f"It is {sky} in {city}, {temp} degrees.")
        return messages, [_variant(WEATHER_TOOL, rng)], answer
    ask, reply = rng.choice(SMALL_TALK)
    answer = f"The user says {ask.rstrip('.!?').lower()}. No tool is needed.\n</think>\n\n{reply}"
    return system + [{"role": "user", "content": ask}], tools if rng.random() < 0.5 else None, answer


def make_agent_checkpoint(out_dir: str | Path, *, steps: int = 500, seed: int = 0, log=print) -> Path:
    """Write the agent checkpoint to `out_dir` and return its path (see the module
    docstring). Deterministic for a given `seed`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tools.make_model import build_config, stdlib_docstrings, train_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    samples = [conversation(rng) for _ in range(3000)]
    raw = [json.dumps(s[0]) + json.dumps(s[1]) + s[2] + CHAT_TEMPLATE for s in samples[:500]]
    tokenizer = train_tokenizer(raw + stdlib_docstrings(200_000), 1024)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    pairs = [(tokenizer.encode(tokenizer.apply_chat_template(m, tools=t, add_generation_prompt=True, tokenize=False)),
              tokenizer.encode(a + "<|end|>")) for m, t, a in samples]
    config = build_config("llama", len(tokenizer), 128, 3, 4, 2, 1024, 0.05)
    config.eos_token_id = [tokenizer.eos_token_id, end]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _train(model, pairs, steps, log)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                                               eos_token_id=[tokenizer.eos_token_id, end], do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    for f in out.iterdir():
        f.chmod(0o644)
    return out


def _train(model, pairs: list[tuple[list[int], list[int]]], steps: int, log) -> None:
    """AdamW on (prompt, answer) pairs: padded batches, the loss on the answers' tokens
    only (the prompts' history turns show empty reasoning, which the answers must not
    learn)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    batch = 16

    def loss_at(step: int):
        picks = torch.randint(0, len(pairs), (batch,), generator=gen).tolist()
        longest = max(len(pairs[i][0]) + len(pairs[i][1]) for i in picks)
        x = torch.zeros(batch, longest, dtype=torch.long)
        labels = torch.full((batch, longest), -100, dtype=torch.long)
        for row, i in enumerate(picks):
            prompt, answer = pairs[i]
            n = len(prompt) + len(answer)
            x[row, :n] = torch.tensor(prompt + answer)
            labels[row, len(prompt):n] = torch.tensor(answer)
        return model(input_ids=x, labels=labels).loss

    fit(model, loss_at, steps, lr=3e-3, weight_decay=0.01, warmup=50, log=log, log_every=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    make_agent_checkpoint(a.out_dir, steps=a.steps, seed=a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
