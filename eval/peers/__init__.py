"""Drivers of the peer tools (llm-compressor, AutoAWQ, GPTQModel): scripts run by the python of each
tool's own venv, never imported by slimserve itself."""
