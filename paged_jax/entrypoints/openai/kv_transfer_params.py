"""vLLM's `kv_transfer_params` on the OpenAI routes: disaggregated prefill / decode servers.

A prefill server gets a request with `"kv_transfer_params": {"do_remote_decode": true}`
(a proxy or router sends it with max_tokens 1): the request runs as usual, and once it
finishes the engine exports the prompt's cached blocks through the server's KV connector
(paged_jax/engine/kv_connector.py), whose params come back in the response's
`kv_transfer_params` with `"do_remote_prefill": true`. The decode server gets the same
request with those params: the handler pulls the K/V (off the event loop: it waits on
the network), the engine thread imports them into the prefix cache right before adding
the request (engine/kv_transfer.py), and generation starts from the cached prompt.

Only one prompt and one completion per request (n = 1, no beams, no echo), not streamed
on the prefill side; anything else is a 400 that says so, as is a server started
without --kv_connector.
"""

from __future__ import annotations

import asyncio

from paged_jax.entrypoints.openai.errors import bad_request

PARAM = "kv_transfer_params"


def mode(body, connector, num_prompts: int, n: int) -> str | None:
    """None (no transfer), "export" (prefill side) or "import" (decode side); 400s for
    what a transfer cannot serve."""
    params = body.kv_transfer_params
    if params is None:
        return None
    if connector is None:
        raise bad_request("this server moves no KV (start it with --kv_connector and --kv_transfer)", PARAM)
    export, load = params.get("do_remote_decode") is True, params.get("do_remote_prefill") is True
    if export == load:
        raise bad_request('kv_transfer_params needs exactly one of "do_remote_decode": true (a prefill server) or '
                          '"do_remote_prefill": true with a prefill server\'s params (a decode server)', PARAM)
    if num_prompts != 1 or n != 1 or getattr(body, "use_beam_search", False) or getattr(body, "echo", False):
        raise bad_request("kv_transfer_params serves one prompt, n = 1, without beam search or echo", PARAM)
    if export and body.stream:
        raise bad_request("a prefill request (do_remote_decode) is answered whole: set stream to false", PARAM)
    return "export" if export else "import"


async def load(connector, params: dict, prompt_token_ids):
    """The prefill server's K/V for this prompt (None when it had no full block to send)."""
    if params.get("connector") is None:
        return None
    try:
        return await asyncio.to_thread(connector.load, params, prompt_token_ids)
    except (KeyError, ValueError, TypeError) as exc:
        raise bad_request(f"kv_transfer_params do not name K/V this server can load: {exc}", PARAM) from exc
