//! Who writes and how: the context every create, update and delete carries,
//! kept apart from the verbs so that admission can read it without
//! depending on them.

use std::sync::Arc;

use crate::UserInfo;
use crate::fields::FieldValidation;

/// Who asks and how.
#[derive(Debug, Clone)]
pub struct WriteCtx {
    /// The authenticated user.
    pub user: UserInfo,
    /// `dryRun=All`: everything but the commit.
    pub dry_run: bool,
    /// `fieldValidation`: what unknown fields in the request lead to.
    pub validation: FieldValidation,
    /// Warnings for the response's `Warning` headers.
    pub warnings: Warnings,
    /// The `fieldManager` parameter; an apply's manager, required for it.
    pub field_manager: Option<String>,
    /// The program name of the request's user agent: the manager other
    /// writes are recorded for when no `fieldManager` is given.
    pub user_agent: String,
    /// `force=true`: an apply takes over the fields it conflicts on.
    pub force: bool,
}

impl WriteCtx {
    /// A write from inside the process: no manager, nothing recorded.
    pub fn internal(user: UserInfo, validation: FieldValidation) -> Self {
        WriteCtx {
            user,
            dry_run: false,
            validation,
            warnings: Warnings::default(),
            field_manager: None,
            user_agent: String::new(),
            force: false,
        }
    }

    /// The manager a create or update is recorded for: the `fieldManager`
    /// parameter, else the user agent's program name (empty for writes
    /// from inside the process, which are not recorded).
    pub fn manager(&self) -> &str {
        self.field_manager.as_deref().unwrap_or(&self.user_agent)
    }
}

/// Warnings a write collects for the response (shared with the caller).
#[derive(Debug, Clone, Default)]
pub struct Warnings(Arc<std::sync::Mutex<Vec<String>>>);

impl Warnings {
    /// Adds a warning once (a write retried after a conflict finds the
    /// same fields again).
    pub(crate) fn push(&self, warning: String) {
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !all.contains(&warning) {
            all.push(warning);
        }
    }

    /// Every warning collected so far, leaving none behind.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}
