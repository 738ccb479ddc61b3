"""Locust load test for a running stepserve server (POST /v1/images/generations, OpenAI images shape).

Locust is closed-loop: each simulated user waits for its answer before sending again, so when the server slows
down the offered load drops with it and queueing delay is partly hidden. Label its numbers "closed-loop"; for
open-loop numbers (the schedule drawn in advance, latency from the scheduled send time) use `stepserve bench`.

    pip install locust
    locust -f benchmarks/locustfile.py --host http://127.0.0.1:8000 --headless \
        --users 16 --spawn-rate 4 --run-time 60s --csv bench-out/locust

Settings (environment variables):
    STEPSERVE_STEPS     step counts drawn uniformly per request (default "8,20,40")
    STEPSERVE_GUIDANCE  guidance_scale (default: the model's own)
    STEPSERVE_SIZE      "WxH" (default: the model's own)
    STEPSERVE_SEED      base seed; user k draws its requests from seed + k, so reruns send the same mix (default 0)
    STEPSERVE_API_KEY   bearer key, when the server was started with --api-key
Each request is reported under a name that carries its step count, so Locust's table and CSV give percentiles
per step count. 429 (over capacity) is reported as a failure named "rejected (429)", never dropped.
"""

from __future__ import annotations

import itertools
import os
import random

from locust import HttpUser, constant, task

from stepserve.util.digits import DIGIT_PROMPTS
from stepserve.request.validation import DRAWN_SEED_LIMIT

ENDPOINT = "/v1/images/generations"
_user_numbers = itertools.count()


def _steps() -> list[int]:
    return [int(s) for s in os.environ.get("STEPSERVE_STEPS", "8,20,40").split(",") if s.strip()]


class ImageUser(HttpUser):
    wait_time = constant(0)  # the next request as soon as the answer is in: a saturating closed loop

    def on_start(self) -> None:
        self.rng = random.Random(int(os.environ.get("STEPSERVE_SEED", "0")) + next(_user_numbers))
        self.steps = _steps()
        key = os.environ.get("STEPSERVE_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    def body(self) -> dict:
        body = {"prompt": self.rng.choice(DIGIT_PROMPTS), "n": 1, "response_format": "b64_json",
                "num_inference_steps": self.rng.choice(self.steps), "seed": self.rng.randrange(DRAWN_SEED_LIMIT)}
        if os.environ.get("STEPSERVE_GUIDANCE"):
            body["guidance_scale"] = float(os.environ["STEPSERVE_GUIDANCE"])
        if os.environ.get("STEPSERVE_SIZE"):
            body["size"] = os.environ["STEPSERVE_SIZE"]
        return body

    @task
    def generate(self) -> None:
        body = self.body()
        name = f"{ENDPOINT} [{body['num_inference_steps']} steps]"
        with self.client.post(ENDPOINT, json=body, name=name, catch_response=True) as resp:
            if resp.status_code == 200:
                resp.success()
            elif resp.status_code == 429:
                resp.failure("rejected (429)")
            else:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
