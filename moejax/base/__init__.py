"""What every layer above stands on: the errors a user can cause (`errors`), the platform's
decisions (`platform`), the compile targets (`targets`) and the router-pick trace format (`trace`)."""
