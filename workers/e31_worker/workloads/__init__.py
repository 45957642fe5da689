"""Built-in workloads: entrypoints that run common batch jobs on `ctx.device`.

| entrypoint | what it does |
|---|---|
| `e31_worker.workloads.batch_inference:run` | a model over JSONL file(s), resumable |
| `e31_worker.workloads.training:run` | training with checkpoints, resume, mixed precision on GPU |
| `e31_worker.workloads.footage:run` | a per-frame model over video files, sampled at a given rate |
| `e31_worker.workloads.llm:run` | a language model over an OpenAI batch file, resumable |

`models` and `data` hold tiny factories (digits MLP/CNN, a frame colour classifier, the
scikit-learn digits data set, a rendered test video) for docs, tests and demos;
`tinymodels` builds the two built-in language models. See
docs/workloads.md. Importing this package imports no torch; each module does.
"""
