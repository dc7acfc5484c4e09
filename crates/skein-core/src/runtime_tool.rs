//! The tools the runtime handles itself instead of running them: delegation, questions,
//! and plans. Their names are what the model calls and what events record.

use std::fmt;

/// The name other systems give `call_agent` (references 002-004:
/// `delegate_to_agent(agent | agent_name | skill_name, task, context)`). An agent whose
/// `tools` list it delegates under that name: its model sees the tool by the name its file
/// uses, with those argument names; the runtime treats it as `call_agent`.
pub const DELEGATE_TO_AGENT: &str = "delegate_to_agent";

/// A tool the runtime handles itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RuntimeTool {
    /// Start a sub-agent, or continue a paused one with its resume token.
    CallAgent,
    /// A follow-up question to a finished `chat: true` sub-agent.
    AskClarification,
    /// Questions for the person (or the parent) the session pauses on.
    AskUser,
    /// The plan owner's own edit of its plan.
    UpdatePlan,
    /// A sub-agent's proposed change to tasks of its parent's plan it was handed.
    ProposePatch,
    /// A router's exit: the request goes on to one of its destinations.
    HandoffTo,
    /// A team member's or supervisor's message to the rest of its team.
    TeamBroadcast,
}

impl RuntimeTool {
    pub const ALL: [RuntimeTool; 7] = [
        RuntimeTool::CallAgent,
        RuntimeTool::AskClarification,
        RuntimeTool::AskUser,
        RuntimeTool::UpdatePlan,
        RuntimeTool::ProposePatch,
        RuntimeTool::HandoffTo,
        RuntimeTool::TeamBroadcast,
    ];

    /// The tool's name, as the model calls it and the log records it.
    pub const fn as_str(self) -> &'static str {
        match self {
            RuntimeTool::CallAgent => "call_agent",
            RuntimeTool::AskClarification => "ask_clarification",
            RuntimeTool::AskUser => "ask_user",
            RuntimeTool::UpdatePlan => "update_plan",
            RuntimeTool::ProposePatch => "propose_patch",
            RuntimeTool::HandoffTo => "handoff_to",
            RuntimeTool::TeamBroadcast => "team_broadcast",
        }
    }

    /// The runtime tool named `name`, if it is one (`delegate_to_agent` is `call_agent`).
    pub fn parse(name: &str) -> Option<RuntimeTool> {
        if name == DELEGATE_TO_AGENT {
            return Some(RuntimeTool::CallAgent);
        }
        RuntimeTool::ALL.into_iter().find(|t| t.as_str() == name)
    }

    /// Whether `name` is this tool's name (or, for `call_agent`, its other name).
    pub fn is(self, name: &str) -> bool {
        name == self.as_str() || (self == RuntimeTool::CallAgent && name == DELEGATE_TO_AGENT)
    }
}

impl fmt::Display for RuntimeTool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::RuntimeTool;

    #[test]
    fn each_name_parses_back_to_its_tool_and_other_names_are_none() {
        for t in RuntimeTool::ALL {
            assert_eq!(RuntimeTool::parse(t.as_str()), Some(t));
            assert!(t.is(&t.to_string()));
        }
        let names: Vec<&str> = RuntimeTool::ALL.iter().map(|t| t.as_str()).collect();
        assert_eq!(
            names,
            [
                "call_agent",
                "ask_clarification",
                "ask_user",
                "update_plan",
                "propose_patch",
                "handoff_to",
                "team_broadcast"
            ]
        );
        assert_eq!(
            RuntimeTool::parse("delegate_to_agent"),
            Some(RuntimeTool::CallAgent)
        );
        assert!(RuntimeTool::CallAgent.is("delegate_to_agent"));
        assert!(!RuntimeTool::AskUser.is("delegate_to_agent"));
        for other in ["read_file", "Call_Agent", "call_agent ", ""] {
            assert_eq!(RuntimeTool::parse(other), None, "{other:?}");
        }
    }

    #[test]
    fn every_runtime_tool_is_a_builtin_and_has_no_side_effects_outside_the_tree() {
        for t in RuntimeTool::ALL {
            assert!(crate::agent::BUILTIN_TOOLS.contains(&t.as_str()), "{t}");
            // `call_agent` counts as the tools of the agents it may start; `ask_user`
            // brings in a person's answer, which no mission hash holds.
            if t == RuntimeTool::AskUser {
                assert!(!crate::agent::SIDE_EFFECT_FREE_TOOLS.contains(&t.as_str()));
            } else if t != RuntimeTool::CallAgent {
                assert!(
                    crate::agent::SIDE_EFFECT_FREE_TOOLS.contains(&t.as_str()),
                    "{t}"
                );
            }
        }
    }
}
