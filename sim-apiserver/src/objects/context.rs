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
