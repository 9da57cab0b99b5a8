"""Offline steering demo on the embedded default model (SmolLM2-135M-Instruct, CPU is enough).

1. Build a contrastive steering vector (mean residual stream after layer L on "formal"
   minus "pirate" phrasings) with a plain HF forward of the same model.
2. Start vLLM with the dynsteer plugin (torch.compile on) and generate the same prompts
   unsteered, steered per request, and with global steering; a mixed batch shows that the
   unsteered requests are untouched.

Run: ``make demo`` (or ``python experiments/demo.py``).
"""

from __future__ import annotations

import os
import time

from pirate import LAYER, PIRATE, PLAIN, SCALE

PROMPTS = ["Tell me about your day.", "What is the best way to learn programming?"]


def steering_vector(path: str):
    """Mean difference of the residual stream after layer LAYER (pirate minus plain)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def mean_stream(texts: list[str]) -> torch.Tensor:
        means = []
        for text in texts:
            ids = tok(text, return_tensors="pt")
            with torch.no_grad():
                hidden = model(**ids, output_hidden_states=True).hidden_states[LAYER + 1]
            means.append(hidden[0].mean(0))
        return torch.stack(means).mean(0)

    return (mean_stream(PIRATE) - mean_stream(PLAIN)).numpy()


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from dynsteer.engine_ext import Steering
    from dynsteer.engine_ext.default_model import default_model_path

    path = str(default_model_path())
    print(f"[demo] model: {path}")
    vec = steering_vector(path)
    t0 = time.time()
    llm = LLM(path, dtype="float32", max_model_len=512, max_num_seqs=8, seed=0,
              additional_config={"dynsteer": {"sites": "post_block@*"}})
    print(f"[demo] engine started in {time.time() - t0:.0f} s (compile on, plugin enabled)")
    steering = Steering(llm)
    steering.register_vector("pirate", vec)
    spec = {"steer": [{"vector": "pirate", "layers": [LAYER], "scale": SCALE}]}
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]

    def chat(specs: list[dict | None]) -> list[str]:
        params = [SamplingParams(max_tokens=40, temperature=0.0,
                                 extra_args={"dynsteer": s} if s else None) for s in specs]
        outs = llm.chat(chats * (len(specs) // len(chats)), params, use_tqdm=False)
        return [o.outputs[0].text.strip().replace("\n", " ") for o in outs]

    base = chat([None, None])
    mixed = chat([spec, None, None, spec])
    steering.set_global([{"vector": "pirate", "layers": [LAYER], "scale": SCALE}])
    glob = chat([None, None])
    steering.clear_global()
    after = chat([None, None])
    for i, prompt in enumerate(PROMPTS):
        print(f"\n=== {prompt}")
        print(f"unsteered          : {base[i]}")
        print(f"steered (request)  : {mixed[0] if i == 0 else mixed[3]}")
        print(f"steered (global)   : {glob[i]}")
    unsteered_ok = mixed[1] == base[1] and mixed[2] == base[0] and after == base
    print(f"\n[demo] unsteered requests in the mixed batch and after clearing global steering "
          f"equal the baseline: {unsteered_ok}")
    print(f"[demo] worker counters: {steering.info()[0]}")


if __name__ == "__main__":
    main()
