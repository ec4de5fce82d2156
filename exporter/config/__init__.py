"""YAML with line numbers (``yamlconf``), the one validator family (``validate``) and the
agent's typed settings (``settings``)."""
