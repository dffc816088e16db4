"""An empty YAML file (the wrong file, or one not written yet) given as the job's configuration."""

from pathlib import Path

from hybridmem import HybridConfig

Path("job.yaml").write_text("# to do\n")
HybridConfig.from_yaml("job.yaml")
print("accepted")
