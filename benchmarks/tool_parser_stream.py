"""What streaming a long tool call costs the HTTP process: each tool-call format's parser fed a
~16,000-character output (a call whose arguments hold one long string, after some content)
four characters at a time, as a stream delivers it; the parser scans its whole text at every
delta, so the cost of a delta grows with the output.

    python benchmarks/tool_parser_stream.py [--chars 16000] [--piece 4]

Figures: docs/PERFORMANCE.md, "Streaming tool calls".
"""

from __future__ import annotations

import argparse
import json
import time

from fd_server.parsers.tools import (
    CALL,
    CALL_END,
    CALLS,
    CALLS_END,
    SEP,
    TOOL_FORMATS,
    ToolStream,
)


def outputs(chars: int) -> dict[str, str]:
    args = json.dumps({"text": "lorem ipsum dolor sit amet " * (chars // 27)})
    return {
        "hermes": "Let me check. " * 200 + '<tool_call>\n{"name": "write", "arguments": ' + args + "}\n</tool_call>",
        "llama3_json": '<|python_tag|>{"name": "write", "parameters": ' + args + "}",
        "deepseek_v3": ("ok " * 200 + CALLS + CALL + "function" + SEP + "write\n```json\n" + args + "\n```" + CALL_END
                        + CALLS_END),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chars", type=int, default=16000)
    ap.add_argument("--piece", type=int, default=4, help="characters a delta")
    args = ap.parse_args()
    for name, text in outputs(args.chars).items():
        stream = ToolStream(TOOL_FORMATS[name])
        start = time.perf_counter()
        feeds = 0
        for i in range(0, len(text), args.piece):
            stream.feed(text[i : i + args.piece])
            feeds += 1
        stream.finish()
        seconds = time.perf_counter() - start
        assert len(stream.calls) == 1, name
        print(f"{name:>12}: {len(text)} characters, {feeds} deltas, {seconds * 1e3:.0f} ms in all, "
              f"{seconds / feeds * 1e6:.1f} us a delta")


if __name__ == "__main__":
    main()
