"""Mirror of vllm_ascend/utils.py: is_310p (the device family check)."""

# Tests set this to pretend the device is a 310P.
FAKE_IS_310P = False


def is_310p() -> bool:
    return FAKE_IS_310P
