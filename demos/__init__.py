"""The Gradio demo: a client of the fedmosaic HTTP API only (it imports none of the other packages)."""
