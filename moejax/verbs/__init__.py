"""The CLI's verbs that belong to no package: `generate` and `score` (`commands`), `compare`, and
`plan` (`plan_command`)."""
