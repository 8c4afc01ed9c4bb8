"""lm-evaluation-harness against the server: a local multiple-choice task scored through
``local-completions`` (loglikelihood requests: ``echo`` with ``logprobs``).

    python -m benchmarks.lm_eval_server --lm-eval-python /path/to/venv/bin/python

The task is written here, from the shipped held-out Python (``kimi_k3/default/heldout.txt``),
so nothing is downloaded: each item is a few lines of a held-out file and four candidate
next lines, the real one and three lines from elsewhere in the sample; ``acc`` is the share
of items whose real line gets the highest log-likelihood. The server (``python -m
kimi_k3.server`` on the embedded default) scores them; lm-evaluation-harness needs the
model's tokenizer to split context from continuation, so the checkpoint's tokenizer is
written as a Hugging Face ``tokenizer.json`` beside the task (the same ``tokenizers``
backend the server uses: the same ids). lm-evaluation-harness runs in the interpreter
given (it is not a dependency of this project; it installs with ``pip install
'lm-eval[api]'`` and ``transformers``). The same items are also scored in this process
straight from the model, and that accuracy is printed beside lm-evaluation-harness's table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from benchmarks.bench_server import Server

TASK = "kimi_k3_next_line"
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{choices}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def items(text: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` items: 6 lines of context, the next line and 3 other lines as choices."""
    lines = [ln for ln in text.splitlines() if len(ln.strip()) > 12]
    rng = random.Random(seed)
    out = []
    for start in rng.sample(range(6, len(lines) - 1), n):
        real = lines[start]
        others = rng.sample([ln for ln in lines if ln != real], 3)
        choices = [real, *others]
        rng.shuffle(choices)
        context = "\n".join(lines[start - 6 : start]) + "\n"
        out.append({"context": context, "choices": choices, "label": choices.index(real)})
    return out


def write_hf_tokenizer(checkpoint: Path, out: Path) -> Path:
    """The checkpoint's tokenizer as a Hugging Face tokenizer directory."""
    from kimi_k3.text.tokenizer import load_tokenizer

    load_tokenizer(checkpoint)._tokenizer.save_pretrained(out)
    return out


def direct_scores(checkpoint: Path, docs: list[dict]) -> list[list[float]]:
    """Each choice's summed log-likelihood given its context, straight from the model (the
    server's dtype), tokenized as lm-evaluation-harness does (context, then context +
    continuation, the continuation's ids being those past the context's)."""
    import kimi_k3

    model, tok = kimi_k3.load(checkpoint)
    scores = []
    for d in docs:
        ctx = tok.encode(d["context"], add_special_tokens=False)
        row = []
        for choice in d["choices"]:
            whole = tok.encode(d["context"] + choice, add_special_tokens=False)
            logits = model(mx.array([whole]))[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            row.append(sum(lp[j - 1, whole[j]].item() for j in range(len(ctx), len(whole))))
        scores.append(row)
    return scores


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm-eval-python", default=sys.executable, help="interpreter with lm_eval")
    p.add_argument("--items", type=int, default=40)
    p.add_argument("--out", help="also write the report here")
    return p


def main(argv=None) -> str:
    a = setup_arg_parser().parse_args(argv)
    from kimi_k3.default_model import ensure_default_model, heldout_text

    checkpoint = Path(ensure_default_model())
    docs = items(heldout_text(), a.items)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "items.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp / f"{TASK}.yaml").write_text(YAML.format(task=TASK, data=data))
        tok_dir = write_hf_tokenizer(checkpoint, tmp / "tokenizer")
        with Server(checkpoint, None) as server:
            model_id = server.get("/v1/models")["data"][0]["id"]
            args = (
                f"model={model_id},base_url={server.url}/v1/completions,"
                f"tokenizer_backend=huggingface,tokenizer={tok_dir},"
                "tokenized_requests=True,num_concurrent=1,max_retries=1"
            )
            cmd = [a.lm_eval_python, "-m", "lm_eval", "--model", "local-completions"]
            cmd += ["--model_args", args, "--tasks", TASK, "--include_path", str(tmp)]
            cmd += ["--output_path", str(tmp / "results")]
            env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
            run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0:
            raise SystemExit(f"lm_eval failed ({run.returncode}):\n{run.stderr[-4000:]}")
        table = "\n".join(ln for ln in run.stdout.splitlines() if ln.startswith("|"))
        result = json.loads(next((tmp / "results").rglob("results_*.json")).read_text())
        acc = result["results"][TASK]["acc,none"]
    scores = direct_scores(checkpoint, docs)
    direct = sum(max(range(4), key=r.__getitem__) == d["label"] for r, d in zip(scores, docs))
    report = (
        f"lm-evaluation-harness (local-completions) against the server, {len(docs)} items:\n\n"
        f"{table}\n\nacc through the server: {acc:.4f}; scored straight from the model: "
        f"{direct / len(docs):.4f}"
    )
    print(report)
    if a.out:
        Path(a.out).write_text(report + "\n")
    return report


if __name__ == "__main__":
    main()
