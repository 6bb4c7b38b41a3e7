"""lm-evaluation-harness against `jaxkv serve` and against transformers, on two small tasks this
repository ships (benchmarks/evals/: 40 multiple-choice questions scored by log-likelihood, 10
short questions answered by greedy generation, scored by exact match of the answer's last word).

jaxkv is reached as lm-eval's `local-completions` model with the `remote` tokenizer (the
server's /tokenize and /tokenizer_info, so the server runs with
--enable-tokenizer-info-endpoint); log-likelihoods come from /v1/completions with echo and
max_tokens 0, generations from greedy completions. transformers is lm-eval's `hf` model on the
same weights (the embedded GGUF file, dequantized to float32). Prints both scores, the largest
difference of a choice's log-likelihood, and how many generations are identical.

    pip install -e ".[bench]"      # lm-eval, torch, accelerate, ...
    python benchmarks/evals.py [--quick]
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import base_parser, print_table, save  # noqa: E402
from benchmarks.serving import Server, free_port  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "evals")
TASKS = {
    "jaxkv_mc": """task: jaxkv_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "jaxkv_gen": """task: jaxkv_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0.0
filter_list:
  - name: last_word
    filter:
      - function: regex
        regex_pattern: "(\\\\w+)\\\\W*$"
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""",
}


def write_tasks(folder: str) -> None:
    for name, text in TASKS.items():
        with open(os.path.join(folder, name + ".yaml"), "w") as f:
            f.write(text.format(data=HERE))


def evaluate(model: str, model_args: str, tasks_dir: str, limit: int | None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                   task_manager=TaskManager(include_path=tasks_dir), limit=limit,
                                   log_samples=True, batch_size=1)


def loglikelihoods(res: dict) -> dict:
    """(doc_id, choice) -> log-likelihood of the multiple-choice task's samples."""
    return {(s["doc_id"], i): float(r[0][0]) for s in res["samples"]["jaxkv_mc"]
            for i, r in enumerate(s["resps"])}


def generations(res: dict) -> dict:
    return {s["doc_id"]: s["filtered_resps"][0] for s in res["samples"]["jaxkv_gen"]}


def main() -> None:
    p = base_parser("lm-eval against jaxkv serve and transformers",
                    "the first 10 questions of each task")
    args = p.parse_args()
    limit = 10 if args.quick else None
    from jaxkv.loader.gguf import embedded_model_path
    gguf = embedded_model_path()
    port = free_port()
    server = Server([sys.executable, "-m", "jaxkv.cli", "serve", "--port", str(port),
                     "--enable-tokenizer-info-endpoint", "--disable-uvicorn-access-log",
                     "--max-model-len", "1024", "--max-num-batched-tokens", "64",
                     "--token-buckets", "1,8,64"], port, "/health")
    with tempfile.TemporaryDirectory() as tasks_dir:
        write_tasks(tasks_dir)
        try:
            jx = evaluate("local-completions",
                          f"base_url={server.url}/v1/completions,model=SmolLM2-135M-Instruct,"
                          "tokenizer_backend=remote,tokenized_requests=True,num_concurrent=1,"
                          "max_retries=1,max_length=1024", tasks_dir, limit)
        finally:
            server.stop()
        hf = evaluate("hf", f"pretrained={os.path.dirname(gguf)},gguf_file={os.path.basename(gguf)},"
                      "dtype=float32,device=cpu", tasks_dir, limit)
    a, b = loglikelihoods(jx), loglikelihoods(hf)
    gen_a, gen_b = generations(jx), generations(hf)
    rows = [{"engine": name, "acc": r["results"]["jaxkv_mc"]["acc,none"],
             "acc_norm": r["results"]["jaxkv_mc"]["acc_norm,none"],
             "exact_match": r["results"]["jaxkv_gen"]["exact_match,last_word"]}
            for name, r in (("jaxkv serve", jx), ("transformers", hf))]
    print_table(rows, floatfmt="{:.3f}")
    diff = max(abs(a[k] - b[k]) for k in a)
    same = sum(gen_a[k] == gen_b[k] for k in gen_a)
    print(f"largest log-likelihood difference over {len(a)} choices: {diff:.2e}; "
          f"identical generations: {same} of {len(gen_a)}")
    save("evals", {"rows": rows, "max_loglikelihood_diff": diff, "choices": len(a),
                   "identical_generations": same, "generations": len(gen_a)}, args)


if __name__ == "__main__":
    main()
