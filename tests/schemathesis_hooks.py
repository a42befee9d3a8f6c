"""Schemathesis hooks (loaded through SCHEMATHESIS_HOOKS): generated requests name the served model.

Random model ids would all be 404s, which stops the fuzzing at the door; with the served id, every
generated body reaches validation, admission and the engine. Unknown models have tests of their own.
"""

import os

import schemathesis

MODEL = os.environ["INFERKILN_FUZZ_MODEL"]


@schemathesis.hook
def map_body(ctx, body):
    if isinstance(body, dict) and "model" in body:
        body["model"] = MODEL
    return body
