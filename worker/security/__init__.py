"""Security of every client the project makes: the Kafka and Redis settings (TLS, SASL, ACL users), the ACL recipe, and refusals (`AccessError`) that retrying cannot fix."""
