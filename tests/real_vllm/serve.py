"""Runs one vLLM OpenAI server (the CPU build) for Sluice's tests, and ends it, with every
process it started, when the test process that asked for it is gone, whichever way it went
(a test binary's shared servers are never dropped: the watch is what stops them).

Usage: serve.py PARENT_PID -- VLLM_SERVER_ARGS...
SIGTERM ends the server at once (a crash, as far as clients see).
"""

import os
import signal
import subprocess
import sys
import time


def main():
    parent = int(sys.argv[1])
    args = sys.argv[sys.argv.index("--") + 1 :]
    # The Responses API keeps responses (for `previous_response_id`) only with the store on.
    env = dict(
        os.environ,
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        VLLM_ENABLE_RESPONSES_API_STORE="1",
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args],
        env=env,
        start_new_session=True,
    )

    def stop(*_):
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while server.poll() is None:
        if os.getppid() != parent:
            stop()
        time.sleep(0.5)
    stop()


if __name__ == "__main__":
    main()
