"""The Python client tour of the README, runnable against `e31 up`:  python examples/client_tour.py"""

from e31 import Client, JobFailed

client = Client()  # the profile `e31 up` wrote; or Client(url=..., token=...), or E31_URL / E31_TOKEN

job = client.submit(entrypoint="e31_worker.examples:hello", params={"name": "python"},
                    resources={"gpus": 1, "gpu_mem_gb": 40}, retries={"max": 2},
                    timeout_s=600, name="hello-from-python")
print("submitted", job.id)
status = job.wait(timeout=300)                 # raises JobFailed unless it succeeded
print("result", job.result())
last = status["attempts"][-1]                  # the attempt that succeeded
print("ran on GPU", last["gpus"], "of", last["worker"])  # the GPU's index on its host, as `e31 top` shows
print("outputs", [str(p) for p in job.download("out/hello")])
print(job.logs())

sleeper = client.submit(entrypoint="e31_worker.examples:sleep", params={"seconds": 120},
                        resources={"gpus": 0})
sleeper.cancel()
try:
    sleeper.wait(timeout=60)
except JobFailed as failed:
    print("as expected:", failed.reason)

for row in client.usage():
    print(row["tenant"], row["size_class"], row["jobs"], "GPU-s", row["gpu_seconds"])
