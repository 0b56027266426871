"""An OpenAI-compatible HTTP server on the paged engine (FastAPI + uvicorn).

    engine = LLMEngine("smollm2-135m", EngineConfig(...))
    app = build_app(engine, ServerSettings(served_model_name="smollm2-135m"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

`python -m experiments.serve_local` does exactly this from flags.
"""

from paged_jax.entrypoints.openai.app import ServerSettings, build_app

__all__ = ["ServerSettings", "build_app"]
