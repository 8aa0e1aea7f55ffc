"""The Gradio app: chat with a client's personalised model, compare global/local/combined, manage adapters.

A client of the fedmosaic HTTP API only (:mod:`demos.client`); it imports none of the project's
packages. Tabs:

* **Chat**: pick a FedDPA client (global + local mixed per prompt, paper 000 section 4.3), the global
  adapter, a client's local adapter alone, any loaded adapter or the base model; answers stream in;
  below each answer, the FedDPA weight ``a`` and how the server obtained it (instance-wise: S, mean
  similarity, lambda; or fixed), the raw ``fedmosaic`` field and, for AMoLE clients, a heatmap of the
  experts the tokens went to per layer.
* **Compare**: one prompt to ``global``, ``<client>:local`` and ``<client>`` side by side.
* **Adapters**: ``/v1/models`` as a table, load (or replace) and unload adapters at run time.
* **Evaluation**: the served run's ``eval/`` tables and plots (``GET /v1/run/files``).
"""

from __future__ import annotations

import gradio as gr

from demos.client import ApiClient
from demos.handlers import FORMATS, INSTRUCTION, Handlers

INTRO = """# fedmosaic demo
One frozen base model, many LoRA adapters trained with federated learning. A **client** answers with its
**global** and **local** adapters mixed per prompt (FedDPA: the local weight *a* grows with how similar the
prompt is to that client's own data). Everything here goes through the server's OpenAI-compatible API at
`{url}`."""


def build_app(client: ApiClient) -> gr.Blocks:
    """Build the UI over ``client`` (not launched)."""
    h = Handlers(client)
    with gr.Blocks(title="fedmosaic demo", analytics_enabled=False) as app:
        gr.Markdown(INTRO.format(url=client.base_url))
        with gr.Row():
            status = gr.Markdown("_connecting…_", elem_id="status")
            refresh = gr.Button("Refresh models", size="sm", scale=0, elem_id="refresh")
        with gr.Row():
            fmt = gr.Radio(list(FORMATS), value=INSTRUCTION, label="prompt format",
                           info="the adapters were trained on the instruction template")
            max_tokens = gr.Slider(1, 512, value=64, step=1, label="max tokens")
            temperature = gr.Slider(0.0, 1.5, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                    elem_id="temperature")

        with gr.Tab("Chat"):
            target = gr.Dropdown([], label="model: a client, global, a local adapter or the base",
                                 elem_id="target", interactive=True)
            chatbot = gr.Chatbot(elem_id="chat", height=360, label="conversation")
            with gr.Row():
                prompt = gr.Textbox(placeholder="Ask something, e.g. Sort these words: pear apple fig",
                                    show_label=False, scale=5, elem_id="prompt", lines=1)
                send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                clear = gr.Button("Clear", scale=0)
            route = gr.Markdown(elem_id="route")
            heat = gr.Plot(label="AMoLE: experts chosen per layer (outlined: assigned to this client)", visible=False,
                           elem_id="experts")
            with gr.Accordion("raw fedmosaic field of the last answer", open=False):
                extension = gr.JSON(elem_id="extension")

        with gr.Tab("Compare"):
            compare_client = gr.Dropdown([], label="client", elem_id="compare-client", interactive=True)
            compare_prompt = gr.Textbox(label="prompt", elem_id="compare-prompt")
            compare_btn = gr.Button("Answer three ways", variant="primary", elem_id="compare-send")
            with gr.Row():
                out_global = gr.Textbox(label="global adapter", lines=6, elem_id="answer-global")
                out_local = gr.Textbox(label="the client's local adapter", lines=6, elem_id="answer-local")
                out_combined = gr.Textbox(label="combined (FedDPA)", lines=6, elem_id="answer-combined")
            compare_route = gr.Markdown(elem_id="compare-route")

        with gr.Tab("Adapters"):
            table = gr.Dataframe(headers=["model", "kind", "version", "pinned", "loaded", "folder"],
                                 interactive=False, elem_id="adapters")
            with gr.Row():
                load_name = gr.Textbox(label="name", scale=1)
                load_path = gr.Textbox(label="PEFT folder (inside the server's adapter root)", scale=3)
                pinned = gr.Checkbox(label="pinned", value=False)
                replace = gr.Checkbox(label="replace (new version)", value=False)
                load_btn = gr.Button("Load", variant="primary")
            with gr.Row():
                unload_name = gr.Dropdown([], label="loaded adapter", interactive=True)
                unload_btn = gr.Button("Unload", variant="stop")
            adapter_msg = gr.Markdown(elem_id="adapter-message")

        with gr.Tab("Evaluation"):
            eval_status = gr.Markdown(elem_id="eval-status")
            eval_refresh = gr.Button("Reload evaluation", size="sm")
            eval_tables = gr.Markdown(elem_id="eval-tables")
            eval_plots = gr.Gallery(label="plots", columns=2, height="auto", elem_id="eval-plots")

        listing = [status, target, compare_client, unload_name, table]
        refresh.click(h.refresh, inputs=[target], outputs=listing)
        app.load(h.refresh, inputs=[target], outputs=listing)
        app.load(h.evaluation, outputs=[eval_tables, eval_plots, eval_status])
        eval_refresh.click(h.evaluation, outputs=[eval_tables, eval_plots, eval_status])
        chat_in = [prompt, chatbot, target, fmt, max_tokens, temperature]
        chat_out = [chatbot, prompt, route, extension, heat]
        send.click(fn=h.chat, inputs=chat_in, outputs=chat_out)
        prompt.submit(fn=h.chat, inputs=chat_in, outputs=chat_out)
        clear.click(lambda: ([], "", None, gr.update(visible=False)), outputs=[chatbot, route, extension, heat])
        compare_btn.click(h.compare, inputs=[compare_client, compare_prompt, fmt, max_tokens, temperature],
                          outputs=[out_global, out_local, out_combined, compare_route])
        load_btn.click(h.load_adapter, inputs=[load_name, load_path, pinned, replace, target],
                       outputs=[adapter_msg, *listing])
        unload_btn.click(h.unload_adapter, inputs=[unload_name, target], outputs=[adapter_msg, *listing])
    return app
