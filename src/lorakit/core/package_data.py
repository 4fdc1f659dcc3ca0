"""Files the package ships besides its code, found inside the installed package (a plain `pip install .` has no
repository around it): the DeepSpeed configs, lorakit/ds_configs/, which the repository's ds_configs/ links to so
that the design card's `--deepspeed ds_configs/ds_zero2_no_offload.json` keeps working from a clone."""

from importlib.resources import files

DS_CONFIGS = str(files("lorakit") / "ds_configs")
