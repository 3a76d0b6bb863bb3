"""What `prefect deploy` / `serve` need beyond prefect.yaml."""
