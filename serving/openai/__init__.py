"""The OpenAI wire format without FastAPI: shared by the HTTP API (:mod:`serving.api`) and the batch runner.

``schemas`` holds the pydantic request and response models, ``builders`` turns a request into engine
requests, ``responses`` turns results into responses and stream chunks, and ``errors`` maps an error to
its status and the OpenAI error envelope.
"""
