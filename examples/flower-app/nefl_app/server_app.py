"""The ServerApp: nefl-zoo's Flower engine, configured by this app's run config."""

from pathlib import Path

from nefl_zoo.fl.flower import server_app

app = server_app(Path(__file__).resolve().parents[1])
